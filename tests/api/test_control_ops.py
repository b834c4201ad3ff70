"""SGLang's control operations on the offline Engine (the same typed rank messages as the HTTP
endpoints): memory release and resume, update_weights_from_disk, get_weights_by_name, profiling,
get_server_info. One Engine on the default model (A), fp32 so that outputs compare exactly."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine import Engine
from pdserve.engine.mem_cache.host_memory import OS_PAGE
from pdserve.engine.model_source import resolve_model_path

pytestmark = pytest.mark.timeout(600)

FLAGS = dict(dtype="float32", max_total_tokens=8192, num_threads=1)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Roses are red, violets are"]
LONG_PROMPT = "Count: 1, 2, 3,"
MIB = 2**20


@pytest.fixture(scope="module")
def engine():
    with Engine(rank_on_thread=True, **FLAGS) as e:
        yield e


def ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]



def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * OS_PAGE

def model_bytes(model) -> int:
    from pdserve.engine.model_executor.layers.loader import iter_modules

    tensors = [v for _, m in iter_modules(model) for obj in (m, getattr(m, "method", m))
               for v in vars(obj).values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def wait_idle(engine) -> None:
    """Until the rank has taken the last abort's step (release needs an idle rank, as SGLang's)."""
    deadline = time.monotonic() + 30
    while engine.call(engine.loop.has_work):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_release_and_resume_memory_occupation(engine):
    before = ids(engine.generate(PROMPTS, GREEDY))
    pool = engine.loop.pool
    pool_bytes = sum(t.numel() * t.element_size() for t in (*pool.k, *pool.v))
    weight_bytes = engine.call(lambda: model_bytes(engine.loop.runner.model))

    stream = engine.generate(LONG_PROMPT, LONG, stream=True, rid="busy")
    next(stream)
    with pytest.raises(RuntimeError, match="not idle"):
        engine.release_memory_occupation()
    engine.abort("busy")
    list(stream)
    wait_idle(engine)

    rss0 = rss_bytes()
    assert "kv_cache" in engine.release_memory_occupation(["kv_cache"])
    rss1 = rss_bytes()
    assert rss0 - rss1 >= 0.9 * pool_bytes, (rss0 - rss1) / MIB
    refused = engine.generate("hi", GREEDY)
    assert refused["meta_info"]["finish_reason"]["type"] == "error"
    assert "resume_memory_occupation" in refused["meta_info"]["finish_reason"]["message"]

    engine.release_memory_occupation(["weights"])
    rss2 = rss_bytes()
    assert rss1 - rss2 >= 0.8 * weight_bytes, ((rss1 - rss2) / MIB, weight_bytes / MIB)

    engine.resume_memory_occupation()  # both tags
    assert rss_bytes() - rss2 >= 0.9 * pool_bytes
    assert ids(engine.generate(PROMPTS, GREEDY)) == before
    engine.check_integrity()


def test_update_weights_from_disk(engine, checkpoint_b):
    old_long = engine.generate(LONG_PROMPT, LONG)["output_ids"]
    old = ids(engine.generate(PROMPTS, GREEDY))
    name = "model.layers.3.self_attn.k_proj.weight"
    old_rows = engine.get_weights_by_name(name, truncate_size=2)

    # a request in flight finishes on the old weights; one sent while the update waits runs on the new
    stream = engine.generate(LONG_PROMPT, LONG, stream=True)
    first = next(stream)
    result = {}
    updater = threading.Thread(target=lambda: result.update(ok=engine.update_weights_from_disk(checkpoint_b)))
    updater.start()
    time.sleep(0.5)  # the update reaches the rank first
    held = engine.generate(PROMPTS[0], GREEDY)
    updater.join(300)
    chunks = [first, *stream]
    assert result["ok"][0], result["ok"][1]
    assert chunks[-1]["output_ids"] == old_long and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    new = ids(engine.generate(PROMPTS, GREEDY))
    with Engine(model_path=checkpoint_b, **FLAGS) as b:
        ref = ids(b.generate(PROMPTS, GREEDY))
    assert new == ref and new != old
    assert held["output_ids"] == ref[0]
    # the weight the rank holds is B's (q | k | v rows of the fused matrix mapped back)
    rows = engine.get_weights_by_name(name, truncate_size=2)
    want = load_file(os.path.join(checkpoint_b, "model.safetensors"))[name][:2]
    assert torch.equal(torch.tensor(rows), want.float()) and rows != old_rows
    with pytest.raises(ValueError, match="no weight named"):
        engine.get_weights_by_name("model.layers.99.mlp.up_proj.weight")

    # abort_all_requests: what is in flight ends with abort; back on A
    stream = engine.generate(LONG_PROMPT, LONG, stream=True)
    next(stream)
    ok, message = engine.update_weights_from_disk(resolve_model_path(None).path, abort_all_requests=True)
    assert ok, message
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert ids(engine.generate(PROMPTS, GREEDY)) == old

    # another architecture is refused and the weights stay
    ok, message = engine.update_weights_from_disk("/no/such/checkpoint")
    assert not ok and "does not exist" in message
    assert ids(engine.generate(PROMPTS, GREEDY)) == old
    engine.check_integrity()


def test_profile_writes_a_trace(engine, tmp_path):
    engine.start_profile(str(tmp_path / "manual"))
    with pytest.raises(RuntimeError, match="already running"):
        engine.start_profile(str(tmp_path / "twice"))
    engine.generate(PROMPTS[0], GREEDY)
    message = engine.stop_profile()
    path = message.rsplit(" ", 1)[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    # num_steps: the trace is written after that many steps, without stop_profile
    engine.start_profile(str(tmp_path / "steps"), num_steps=2)
    engine.generate(PROMPTS[0], GREEDY)
    assert len(os.listdir(tmp_path / "steps")) == 1
    with pytest.raises(RuntimeError, match="no profile"):
        engine.stop_profile()


def test_get_server_info(engine):
    info = engine.get_server_info()
    assert info["disaggregation_mode"] == "null" and info["dp_size"] == 1 and info["dtype"] == "float32"
    assert info["max_total_num_tokens"] == 8192 and info["internal_states"][0]["dp_rank"] == 0
    assert info["incremental_streaming_output"] is False
