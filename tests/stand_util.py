"""Shared by the test stands that run real servers: wait until a process answers ``/health``."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import requests


def wait_healthy(url: str, proc: subprocess.Popen, name: str, log: Callable[[], str], timeout: float,
                 period: float = 0.3) -> None:
    """Poll ``url``/health until it answers 200. Raises RuntimeError (with the log) if ``proc``
    exits first, TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log()}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(period)
    raise TimeoutError(f"{name} not ready within {timeout} s:\n{log()}")
