"""LoRA with the hierarchical cache on the default model, fp32: the same prompt under two adapters
and the base shares no cached page through the host tier or through a real Mooncake Store
(``mooncake_master`` and a ``mooncake_client`` holding the objects); the same adapter again gets
its whole prefix from the tier, with the output it got computed cold; through PD, the decode's
write-back is keyed by adapter too. ``/metrics`` counts the adapter loads."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from pdserve.engine import Engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_loader import load_arch
from pdserve.entrypoints.mooncake_service import MooncakeService
from support.loop_stand import PS, EchoRunner, PDPair, reference
from support.pd_stand import wait_for

pytestmark = pytest.mark.timeout(600)

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = ("A shared system prompt for every turn of this conversation: you are a careful assistant who "
          "answers questions about rivers, bridges and the towns built along them. First question:")
PAGE = 16
RANK = 8


def write_adapter(path, arch, seed: int) -> str:
    """A random PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) on every
    layer's q, v, o and down projections, large enough to change the greedy output."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q_out, kv_out = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"self_attn.q_proj": (arch.hidden_size, q_out), "self_attn.v_proj": (arch.hidden_size, kv_out),
              "self_attn.o_proj": (q_out, arch.hidden_size), "mlp.down_proj": (arch.intermediate_size, arch.hidden_size)}
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g) * 0.1
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "bias": "none",
        "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    arch = load_arch(None)
    return tuple(f"{name}={write_adapter(tmp / name, arch, seed)}" for seed, name in enumerate(("a", "b"), 1))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    service = MooncakeService(str(tmp_path_factory.mktemp("mooncake")), segment_size="256MB").start()
    yield service
    service.stop()


def engine(adapters, store: MooncakeService | None = None) -> Engine:
    """A pool of 6 pages (the prompt takes 3 under each namespace), a host tier 4x it, and with
    ``store`` the storage tier waiting for its prefetch (so a hit is not left to timing)."""
    flags = dict(dtype="float32", max_total_tokens=96, page_size=PAGE, num_threads=2, num_reserved_decode_tokens=8,
                 rank_on_thread=True, lora_paths=adapters, max_loras_per_batch=2,
                 enable_hierarchical_cache=True, hicache_ratio=4.0)
    if store is not None:
        flags.update(hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="wait_complete",
                     hicache_storage_backend_extra_config=json.dumps(store.extra_config()))
    return Engine(**flags)


def run(e: Engine, adapter: str | None) -> tuple[list[int], int]:
    """(output ids, cached prompt tokens) of the prompt under ``adapter`` (None: the base model)."""
    out = e.generate(PROMPT, GREEDY, **({} if adapter is None else {"lora_path": adapter}))
    e.check_integrity()
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def full_prefix(e: Engine) -> int:
    """The prompt's tokens a tier can hold: its whole pages but the last token's (always computed)."""
    n = e.generate(PROMPT, {"max_new_tokens": 1})["meta_info"]["prompt_tokens"]
    return (n - 1) // PAGE * PAGE


def evict_pool(e: Engine) -> None:
    """Every unlocked page of the KV pool out to the host tier (write_through backed them up)."""
    e.call(lambda: e.loop.cache.evict(e.loop.cache.evictable_pages))


def test_host_tier_serves_a_prefix_to_its_own_adapter_only(adapters):
    with engine(adapters) as e:
        cold = {}
        cold["a"], cached = run(e, "a")
        assert cached == 0
        evict_pool(e)  # a's pages now live in host memory only
        for other in ("b", None):
            cold[other], cached = run(e, other)
            assert cached == 0, other  # a's host pages are not theirs
        assert cold["a"] != cold["b"] and cold["a"] != cold[None]
        full = full_prefix(e)  # (the base's pages were in the pool: no host load)
        evict_pool(e)
        for adapter in ("a", "b", None):  # each again: its whole prefix loaded back from host memory
            assert run(e, adapter) == (cold[adapter], full), adapter
        stats = e.call(lambda: e.loop.cache.stats)
        assert stats.host_hit_pages == 3 * full // PAGE


def test_store_shares_an_adapters_pages_between_servers_and_never_across(adapters, store):
    with engine(adapters, store) as writer:
        cold_a, cached = run(writer, "a")
        assert cached == 0
    # closing the writer flushed its puts: a fresh server reads a's pages from the store
    with engine(adapters, store) as reader:
        cold_b, cached = run(reader, "b")
        assert cached == 0  # a's pages in the store are not b's
        _, cached = run(reader, None)
        assert cached == 0
        evict_pool(reader)
        out, cached = run(reader, "a")
        stats = reader.call(lambda: dataclasses.replace(reader.loop.cache.stats))  # before full_prefix's run
        full = full_prefix(reader)
        assert (out, cached) == (cold_a, full) and full > 0
        assert stats.store_hit_pages == full // PAGE and stats.host_hit_pages == 0
        metrics = reader.call(lambda: {(s.name, s.labels["into"]): s.value for f in reader.loop.sched_families()
                                       for s in f.samples if f.name == "pdserve_lora_adapter_loads"})
        assert metrics == {("pdserve_lora_adapter_loads_total", "host"): 2.0,
                           ("pdserve_lora_adapter_loads_total", "slot"): 2.0}


class LoraEchoRunner(EchoRunner):
    """The loop stand's echo model, serving adapters: their weights have no slot to fill (its KV
    is the same under any adapter, so only the cache's keys can tell adapters apart)."""

    lora = None

    def load_lora(self, loads) -> None:
        pass


def test_decode_write_back_is_keyed_by_adapter(tmp_path):
    """Through PD (the in-process loop stand, a file store): the decode writes a finished turn
    under adapter a back to the store; the next turn under b, and under the base, finds none of
    it, under a the prefill loads the previous answer's pages from the store."""
    adapter_dir = tmp_path / "a"
    adapter_dir.mkdir()
    lora = {"lora_paths": (f"a={adapter_dir}", f"b={adapter_dir}")}
    tiers = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
             "hicache_storage_prefetch_policy": "wait_complete",
             "hicache_storage_backend_extra_config": json.dumps({"path": str(tmp_path / "store")})}
    cfg = EngineConfig(page_size=PS, **lora, **tiers)
    pair = PDPair(p_engine={**lora, **tiers}, d_engine={**lora, **tiers},
                  p_runner=LoraEchoRunner(64, cfg), d_runner=LoraEchoRunner(64, cfg))
    try:
        turn1 = list(range(1, 11))  # 10 tokens
        pair.submit("t1", turn1, max_new=8, lora_path="a")
        pair.run(pair.done("t1"))
        answer = pair.tokens("t1")
        d_cache = pair.decode.cache
        wait_for(d_cache.storage.idle, 10, "the decode's puts")
        assert d_cache.storage.stats.put_pages == 4  # (10 + 8 - 1) // 4 full pages, under a
        assert all("_lora-" in name for name in os.listdir(tmp_path / "store"))
        turn2 = turn1 + answer + [7, 7, 7]  # 5 full pages, the last computed anyway
        p_cache = pair.prefill.cache
        for i, adapter in enumerate(("b", None)):
            pair.submit(f"other{i}", turn2, max_new=4, lora_path=adapter)
            pair.run(pair.done(f"other{i}"))
            assert pair.final("P", f"other{i}").cached_tokens == 0, adapter
        assert p_cache.stats.store_hit_pages == 0
        pair.submit("t2", turn2, max_new=4, lora_path="a")
        pair.run(pair.done("t2"))
        assert pair.tokens("t2") == reference(turn2, 4)
        # pages 1-2 were the prefill's own (turn 1's prompt); 3-4 hold the answer: from the store
        assert p_cache.stats.store_hit_pages == 2
        assert pair.final("D", "t2").cached_tokens == 4 * PS
        pair.settle()
    finally:
        pair.close()
