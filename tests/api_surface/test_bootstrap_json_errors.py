"""The bootstrap server answers every path in JSON: an unknown path is a 404 and a wrong method a 405,
in the same ``{"error": ...}`` shape as its other errors (aiohttp answers them in plain text)."""

from __future__ import annotations

import pytest
import requests

from pdserve.kvtransfer.bootstrap_server import BootstrapServer


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0).start_in_thread()
    yield f"http://127.0.0.1:{s.port}"
    s.stop_thread()


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("PUT", "/routes", 404), ("POST", "/route", 405), ("DELETE", "/health", 405),
])
def test_unknown_paths_and_wrong_methods_are_json(server, method, path, status):
    r = requests.request(method, server + path, timeout=10)
    assert r.status_code == status and r.headers["Content-Type"].startswith("application/json")
    assert path in r.json()["error"]


def test_known_paths_still_answer(server):
    assert requests.get(server + "/health", timeout=10).json()["status"] == "ok"
