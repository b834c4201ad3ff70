"""The engine server's control routes closed to strangers and unable to kill a rank: one real
server (bound on every address, no admin key, a profile folder) for the whole module.

- Without ``--admin-api-key`` a control route answers loopback peers only: a call on this host's
  non-loopback address (a real peer address) gets a 403 naming the flag.
- Control routes take POST with JSON only: GET is a 405, a form or text body a 415.
- A profile goes under ``--profile-dir`` only; a folder outside it, a path as ``profile_id``, an
  ``output_dir`` naming a file, a trace that cannot be written at the end of a step: each is a
  4xx or a logged error, and the server serves on with its pages free.
- ``truncate_size`` is capped.
- The expert distribution routes are control routes too; on this dense model they answer 400
  naming the missing experts, and the server serves on.
"""

from __future__ import annotations

import pytest
import requests
from server_helpers import ServerProcess
from support.netns_util import outward_address

pytestmark = pytest.mark.timeout(300)

GEN = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(profile_dir):
    srv = ServerProcess("--host", "0.0.0.0", "--profile-dir", str(profile_dir))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def alive(server: ServerProcess) -> None:
    """The server still answers and generates."""
    assert server.proc.poll() is None, server.log()
    assert server.get("/health").status_code == 200, server.log()
    r = server.post("/generate", GEN)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3, r.text


def error_of(r: requests.Response) -> dict:
    return r.json()["error"]


def test_control_routes_answer_loopback_only_without_an_admin_key(server):
    outside = f"http://{outward_address()}:{server.port}"
    for path in ("/flush_cache", "/get_weights_by_name", "/start_profile", "/release_memory_occupation"):
        r = requests.post(outside + path, json={}, timeout=10)
        assert r.status_code == 403, (path, r.text)
        assert "--admin-api-key" in error_of(r)["message"] and "loopback" in error_of(r)["message"]
    # inference routes stay open to the same peer; the loopback peer may flush
    assert requests.post(outside + "/generate", json=GEN, timeout=60).status_code == 200
    assert server.control("/flush_cache").status_code == 200


def test_control_routes_take_post_with_json_only(server):
    for path in ("/flush_cache", "/start_profile", "/stop_profile", "/get_weights_by_name"):
        r = requests.get(server.url + path, timeout=10)
        assert r.status_code == 405, (path, r.text)
        assert "POST" in error_of(r)["message"]
    r = requests.post(server.url + "/flush_cache", data={"a": "b"}, timeout=10)  # what a web form sends
    assert r.status_code == 415 and error_of(r)["param"] == "Content-Type", r.text
    r = requests.post(server.url + "/start_profile", data="{}", headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415, r.text
    r = requests.post(server.url + "/flush_cache", timeout=10)  # no body, no type: a no-cors fetch
    assert r.status_code == 415, r.text
    alive(server)


def test_profile_output_stays_under_the_profile_dir(server, profile_dir, tmp_path):
    r = server.control("/start_profile", {"output_dir": str(tmp_path / "elsewhere")})
    assert r.status_code == 400 and error_of(r)["param"] == "output_dir", r.text
    r = server.control("/start_profile", {"output_dir": "../escape"})
    assert r.status_code == 400 and error_of(r)["param"] == "output_dir", r.text
    r = server.control("/start_profile", {"profile_id": "../../etc/x"})
    assert r.status_code == 400 and error_of(r)["param"] == "profile_id", r.text
    assert not (tmp_path / "elsewhere").exists() and not (profile_dir.parent / "escape").exists()
    alive(server)


def test_a_failing_profile_does_not_kill_the_rank(server, profile_dir):
    (profile_dir / "a-file").write_text("not a folder")
    r = server.control("/start_profile", {"output_dir": "a-file"})  # the rank cannot make this folder
    assert r.status_code == 400 and "Start profiling failed" in error_of(r)["message"], r.text
    alive(server)
    # a trace due after one step whose folder became a file meanwhile: logged, the rank goes on
    r = server.control("/start_profile", {"output_dir": "gone", "num_steps": 1})
    assert r.status_code == 200, r.text
    (profile_dir / "gone").rmdir()
    (profile_dir / "gone").write_text("now a file")
    alive(server)
    assert server.control("/stop_profile").status_code == 400  # the failed trace ended that profile
    r = server.control("/start_profile", {"output_dir": "ok", "profile_id": "run1", "num_steps": 1})
    assert r.status_code == 200, r.text
    alive(server)
    assert [p.name for p in (profile_dir / "ok").iterdir()] == ["run1-DP0-TP0.trace.json.gz"]
    server.wait_idle_and_unleaked()


def test_truncate_size_is_capped(server):
    name = "model.layers.0.mlp.up_proj.weight"
    r = server.control("/get_weights_by_name", {"name": name, "truncate_size": 10**9})
    assert r.status_code == 400 and error_of(r)["param"] == "truncate_size", r.text
    r = server.control("/get_weights_by_name", {"name": name, "truncate_size": 2})
    assert r.status_code == 200 and len(r.json()) == 2
    alive(server)
    server.wait_idle_and_unleaked()


def test_expert_distribution_routes_are_control_routes(server):
    paths = ("/start_expert_distribution_record", "/stop_expert_distribution_record",
             "/dump_expert_distribution_record")
    for path in paths:
        assert requests.get(server.url + path, timeout=10).status_code == 405, path
        r = requests.post(server.url + path, data="{}", headers={"Content-Type": "text/plain"}, timeout=10)
        assert r.status_code == 415, (path, r.text)
    r = server.control("/start_expert_distribution_record", {"mode": "stat"})  # no fields taken
    assert r.status_code == 400 and "mode" in error_of(r)["message"], r.text
    for path in (paths[0], paths[2]):
        r = server.control(path)
        assert r.status_code == 400 and "no routed experts" in r.text, (path, r.text)
    alive(server)
