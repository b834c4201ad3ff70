"""Adapter-aware routing. The adapter table, the PD pairing (both legs prefer holders) and the
adapter's KV hashes alone (pure logic); then a real router in front of two real colocated servers
on the default model (SmolLM2, fp32), each started with a different peft adapter: every request
for an adapter lands on the worker holding it (round robin would spread them); the router's
/v1/models lists the base and both adapters; after the holder is drained a request for its
adapter is served by the other worker, which the router had load it (its own /v1/models then
lists it); an adapter given by ``--lora-paths`` alone is loaded where the policy sends its first
request; an unknown adapter is a 400 naming it."""

from __future__ import annotations

import pytest
import requests

from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.workers.adapters import AdapterError, AdapterTable
from support.pd_stand import InProcessRouter, Server, greedy_body, prompt_ids, serving

BASE = "SmolLM2-135M-Instruct"


class _Ep:
    def __init__(self, url: str):
        self.worker = type("W", (), {"url": url})()
        self.key = url


def _models(*adapters: tuple[str, str]) -> dict:
    cards = [{"id": BASE, "object": "model"}]
    cards += [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in adapters]
    return {"object": "list", "data": cards}


def test_table_reads_requests_and_prefers_holders():
    table = AdapterTable({"z": "/cfg/z"})
    table.set_models("http://a", _models(("x", "/p/x")))
    table.set_models("http://b", _models(("y", "/p/y")))
    assert table.union() == {"x": "/p/x", "y": "/p/y"}
    assert table.request_adapters({"lora_path": "x"}) == {"x"}
    assert table.request_adapters({"lora_path": ["x", None, "y"]}) == {"x", "y"}
    assert table.request_adapters({"model": "y"}) == {"y"}
    assert table.request_adapters({"model": f"{BASE}:z"}) == {"z"}
    assert table.request_adapters({"model": BASE}) == frozenset()
    assert table.request_adapters({"model": "another-model"}) == frozenset()  # the workers refuse it
    with pytest.raises(AdapterError, match="lora_path: unknown LoRA adapter 'nope'") as e:
        table.request_adapters({"lora_path": "nope"})
    assert e.value.param == "lora_path"
    with pytest.raises(AdapterError, match="'nope'") as e:
        table.request_adapters({"model": f"{BASE}:nope"})
    assert e.value.param == "model"
    a, b = _Ep("http://a"), _Ep("http://b")
    assert table.prefer([a, b], {"x"}) == [a]
    assert table.prefer([a, b], {"y"}) == [b]
    assert table.prefer([a, b], {"z"}) == [a, b]  # no holder: the policy chooses, then it is loaded
    assert table.missing("http://b", {"x", "y", "z"}) == [("x", "/p/x"), ("z", "/cfg/z")]
    table.set_loaded("http://b", {"y": "/p/y", "x": "/p/x"})
    assert table.prefer([a, b], {"x", "y"}) == [b]
    table.forget("http://b")
    assert table.union() == {"x": "/p/x"}


def test_no_adapter_anywhere_reads_nothing():
    """A fleet without adapters: the router leaves lora_path to its workers (as before)."""
    table = AdapterTable()
    table.set_models("http://a", _models())
    assert table.request_adapters({"lora_path": "x", "model": "x"}) == frozenset()


def test_pd_pairs_prefer_holders_on_both_legs():
    """Two prefill and two decode workers, round robin: a request for x pairs the prefill and the
    decode worker holding x every time; one for the base alternates over both pairs."""
    import random

    from pdserve.router.config import WorkerSpec
    from pdserve.router.errors import RouterError
    from pdserve.router.simple_policies import RoundRobinPolicy
    from pdserve.router.workers.pairing import Pairing
    from pdserve.router.workers.worker_registry import WorkerRegistry

    reg = WorkerRegistry()
    table = AdapterTable()
    for i, name in enumerate(("x", "y")):
        for role, port in (("prefill", 30000), ("decode", 30001)):
            url = f"http://198.51.100.{10 + i}:{port}"
            w = reg.add(WorkerSpec(url, role, 8998 if role == "prefill" else None), healthy=True)
            reg.set_server_info(w, 1)
            table.set_models(url, _models((name, f"/p/{name}")))
    pairing = Pairing(reg, RoundRobinPolicy(), RoundRobinPolicy(), random.Random(0), adapters=table)
    for _ in range(3):
        pair = pairing.choose({"text": "hi", "lora_path": "y"})
        assert (pair.prefill.key, pair.decode.key) == ("http://198.51.100.11:30000", "http://198.51.100.11:30001")
    hosts = {pairing.choose({"text": "hi"}).decode.key for _ in range(4)}
    assert hosts == {"http://198.51.100.10:30001", "http://198.51.100.11:30001"}
    with pytest.raises(RouterError) as e:
        pairing.choose({"text": "hi", "model": f"{BASE}:nope"})
    assert e.value.status == 400 and e.value.param == "model" and "'nope'" in e.value.message


def test_kv_hashes_are_the_adapters_namespace():
    """kv_aware hashes an adapter's prompt as a worker's radix cache keys its pages under that
    adapter (the namespace ``lora_id_of(name, path)``), so only blocks made under it count."""
    import torch

    from pdserve.engine.lora_names import lora_id_of
    from pdserve.engine.mem_cache.kv_events import block_hashes
    from pdserve.engine.mem_cache.page_pool import PagePool
    from pdserve.engine.mem_cache.radix_cache import RadixCache, cache_key

    table = AdapterTable()
    table.set_models("http://a", _models(("x", "/p/x"), ("y", "/p/y")))
    lora_id = table.namespace(frozenset({"x"}))
    assert lora_id == lora_id_of("x", "/p/x") and table.namespace(frozenset({"x", "y"})) == 0
    pool = PagePool(17, 4, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(pool)
    cache.enable_events()
    tokens = list(range(100, 112))
    for key in (cache_key(tokens, lora_id), tokens):
        pages = pool.alloc(3)
        cache.insert(key, pages, 0)
    under_x, base = cache.drain_events()
    assert under_x.block_hashes == block_hashes(tokens, 4, lora_id)
    assert base.block_hashes == block_hashes(tokens, 4)
    assert not set(under_x.block_hashes) & set(base.block_hashes)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three random peft adapters of the default model: x, y and z."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch

    from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint

    tmp = tmp_path_factory.mktemp("router-lora")
    arch, weights, _ = load_model(None)
    save_hf_checkpoint(arch, weights, str(tmp / "base"))
    del weights
    paths = {}
    for seed, name in enumerate(("x", "y", "z")):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp / "base"), dtype=torch.float32)
        cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                              init_lora_weights=False)
        peft.get_peft_model(model, cfg).save_pretrained(str(tmp / name))
        paths[name] = str(tmp / name)
    return paths


@pytest.fixture(scope="module")
def fleet(adapters):
    """Two colocated servers (x on the first, y on the second) behind a round-robin router that
    may load z from its --lora-paths."""
    servers = {"a": Server("lora-route-a", "null", "--lora-paths", f"x={adapters['x']}"),
               "b": Server("lora-route-b", "null", "--lora-paths", f"y={adapters['y']}")}
    with serving(servers) as s:
        config = RouterConfig(decode=(WorkerSpec(s["a"].url, "decode"), WorkerSpec(s["b"].url, "decode")),
                              policy="round_robin", host="127.0.0.1", port=0, lora_paths=(f"z={adapters['z']}",))
        router = InProcessRouter(config).wait_ready(timeout=300)
        try:
            yield router, s["a"], s["b"]
        finally:
            router.close()


def _generate(router: InProcessRouter, seed: int, **fields) -> requests.Response:
    body = {**greedy_body(prompt_ids(12, seed), 4), **fields}
    return requests.post(f"http://127.0.0.1:{router.port}/generate", json=body, timeout=300)


def _served_by(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.headers["x-pdserve-decode"]


def _adapter_ids(url: str) -> list[str]:
    return [m["id"] for m in requests.get(url + "/v1/models", timeout=30).json()["data"]]


def test_requests_land_on_the_holder(fleet):
    router, a, b = fleet
    assert [_served_by(_generate(router, i, lora_path="x")) for i in range(4)] == [a.url] * 4
    assert [_served_by(_generate(router, i, lora_path="y")) for i in range(4)] == [b.url] * 4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for model in ("x", f"{BASE}:x"):
        r = requests.post(f"http://127.0.0.1:{router.port}/v1/chat/completions", json={**chat, "model": model},
                          timeout=300)
        assert _served_by(r) == a.url, model
    # without an adapter round robin spreads the requests over both
    assert {_served_by(_generate(router, i)) for i in range(4)} == {a.url, b.url}


def test_router_models_list_base_and_every_adapter(fleet):
    router, _, _ = fleet
    data = requests.get(f"http://127.0.0.1:{router.port}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == [BASE, "x", "y"]
    assert all(m["parent"] == BASE for m in data[1:])


def test_unknown_adapter_is_a_400_naming_it(fleet):
    router, _, _ = fleet
    r = _generate(router, 0, lora_path="nope")
    assert r.status_code == 400 and "'nope'" in r.text and r.json()["error"]["param"] == "lora_path", r.text
    r = requests.post(f"http://127.0.0.1:{router.port}/v1/completions",
                      json={"model": f"{BASE}:nope", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "'nope'" in r.text and r.json()["error"]["param"] == "model", r.text


def test_configured_adapter_is_loaded_where_sent(fleet):
    """z is on no worker, only in --lora-paths: its first request loads it on the chosen worker,
    and the next ones go there."""
    router, a, b = fleet
    first = _served_by(_generate(router, 0, lora_path="z"))
    assert "z" in _adapter_ids(first)
    assert [_served_by(_generate(router, i, lora_path="z")) for i in range(1, 4)] == [first] * 3


def test_drained_holder_adapter_loaded_elsewhere(fleet):
    router, a, b = fleet
    base = f"http://127.0.0.1:{router.port}"
    assert "x" not in _adapter_ids(b.url)
    r = requests.post(base + "/workers/drain", json={"url": a.url, "wait_secs": 60}, timeout=120)
    assert r.status_code == 200 and r.json()["drained"], r.text
    try:
        assert [_served_by(_generate(router, i, lora_path="x")) for i in range(3)] == [b.url] * 3
        assert "x" in _adapter_ids(b.url)  # loaded there by the router, from a's listing of x's path
        assert router.router.adapter_sync.loads >= 1
    finally:
        requests.post(base + "/workers/undrain", json={"url": a.url}, timeout=60)
