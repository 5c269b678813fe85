"""Every bench test is bounded in time: a test that runs past 120 s dumps every thread's stack and exits."""

from __future__ import annotations

import faulthandler

import pytest


@pytest.fixture(autouse=True)
def _time_bound():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
