"""Shared by every test folder: this folder on sys.path, so that helper modules beside it (cli_output) import by
basename from tests in subfolders too."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
