"""SGLang's control endpoints on a real engine server (``pdserve serve``), with SGLang's paths,
bodies and answers: /get_server_info, /flush_cache, /update_weights_from_disk,
/get_weights_by_name, /release_memory_occupation, /resume_memory_occupation, /start_profile,
/stop_profile. The server starts on the default model (A) and loads checkpoint B."""

from __future__ import annotations

import os
import sys

import pytest
import requests
import torch
from safetensors.torch import load_file

from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_group, wait_healthy

pytestmark = pytest.mark.timeout(600)

BODY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                "ignore_eos": True}}
WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tmp_path_factory, profile_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = spawn([sys.executable, "-m", "pdserve.engine", "--port", str(port), "--max-total-tokens", "4096",
                  "--num-threads", "1", "--log-level", "warning", "--profile-dir", str(profile_dir)],
                 log, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, name="server", log=lambda: log_tail(log))
        yield url
    finally:
        stop_group(proc)


def post(url: str, path: str, body=None) -> requests.Response:
    return requests.post(url + path, json={} if body is None else body, timeout=300)


def test_control_endpoints(server, checkpoint_b, profile_dir):
    info = requests.get(server + "/get_server_info", timeout=30).json()
    assert info["disaggregation_mode"] == "null" and "disaggregation_bootstrap_port" in info
    old_text = post(server, "/generate", BODY).json()["text"]
    r = post(server, "/get_weights_by_name", {"name": WEIGHT, "truncate_size": 1})
    assert r.status_code == 200
    old_row = r.json()
    assert len(old_row) == 1 and len(old_row[0]) == 576  # the hidden size

    r = post(server, "/update_weights_from_disk", {"model_path": checkpoint_b})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 0
    row = torch.tensor(post(server, "/get_weights_by_name", {"name": WEIGHT, "truncate_size": 1}).json())
    want = load_file(os.path.join(checkpoint_b, "model.safetensors"))[WEIGHT][:1]
    assert torch.allclose(row, want, rtol=1e-2, atol=1e-3)  # bf16 where the CPU runs bf16
    assert not torch.allclose(row, torch.tensor(old_row), rtol=1e-2, atol=1e-3)
    new_text = post(server, "/generate", BODY).json()["text"]
    assert new_text != old_text

    r = post(server, "/update_weights_from_disk", {"model_path": "/no/such/ckpt"})
    assert r.status_code == 400 and r.json()["success"] is False and "does not exist" in r.json()["message"]
    r = post(server, "/update_weights_from_disk", {"model_path": checkpoint_b, "model_pth": 1})
    assert r.status_code == 400 and "model_pth" in r.text
    r = post(server, "/get_weights_by_name", {"name": "no.such.weight"})
    assert r.status_code == 400 and "no.such.weight" in r.text

    r = post(server, "/release_memory_occupation", {})
    assert r.status_code == 200 and r.json()["success"] is True
    r = post(server, "/generate", BODY)
    assert r.status_code >= 400 and "resume_memory_occupation" in r.text
    r = post(server, "/release_memory_occupation", {"tags": ["cuda_graph_x"]})
    assert r.status_code == 400 and "cuda_graph_x" in r.text
    r = post(server, "/resume_memory_occupation", {})
    assert r.status_code == 200 and r.json()["success"] is True
    assert post(server, "/generate", BODY).json()["text"] == new_text  # the weights reloaded are B's

    out = profile_dir / "trace"
    r = post(server, "/start_profile", {"output_dir": "trace"})
    assert r.status_code == 200 and r.text.startswith("Start profiling")
    post(server, "/generate", BODY)
    r = post(server, "/stop_profile")
    assert r.status_code == 200 and r.text.startswith("Stop profiling")
    assert [p.name.endswith(".trace.json.gz") for p in out.iterdir()] == [True]
    r = post(server, "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
