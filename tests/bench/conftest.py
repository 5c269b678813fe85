"""Every bench test is bounded in time: a test that runs past 600 s (the slowest takes ~10 s here) dumps every
thread's stack and exits, so a hung server cannot hold CI to its 90-minute limit."""

from __future__ import annotations

import faulthandler

import pytest


@pytest.fixture(autouse=True)
def _time_bound():
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
