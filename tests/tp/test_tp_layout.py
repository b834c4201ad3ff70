"""The TP layout rules, flags and rank plans: pure, no process started but the refusing server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.entrypoints.flags import parse_serve_args
from pdserve.entrypoints.cluster import LaunchConfig, plan
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_config import check_tp_heads
from pdserve.engine.model_executor.model_loader import load_arch
from pdserve.engine.model_executor.parallel import head_shard
from pdserve.entrypoints.serve import plan_ranks
from pdserve.engine.server_config import ServerConfig


def test_heads_split_or_replicated_as_sglang_does():
    # split: 4 heads / 2 KV heads over 2 ranks
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in (head_shard(r, 2, 4, 2) for r in range(2))] \
        == [(0, 2, 0, 1), (2, 2, 1, 1)]
    # replicated: 4 ranks over 2 KV heads, each rank holds the KV head its query head reads (q // 2)
    shards = [head_shard(r, 4, 4, 2) for r in range(4)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shards] == \
        [(0, 1, 0, 1), (1, 1, 0, 1), (2, 1, 1, 1), (3, 1, 1, 1)]
    check_tp_heads(3, 9, 3)
    check_tp_heads(6, 12, 3)  # 6 % 3 == 0: replicated twice
    with pytest.raises(ValueError, match="tp_size 2 cannot split this model's 6 attention heads and 3 KV heads"):
        check_tp_heads(2, 6, 3)


def test_default_model_tp2_refused_from_its_own_config():
    arch = load_arch(None)  # the GGUF header only
    assert (arch.num_heads, arch.num_kv_heads) == (9, 3)
    arch.check_tp_size(3)
    with pytest.raises(ValueError, match="tp_size 2 cannot split this model's 9 attention heads and 3 KV heads"):
        arch.check_tp_size(2)


@pytest.mark.timeout(60)
def test_serve_tp2_on_default_model_refused_at_start():
    r = subprocess.run([sys.executable, "-m", "pdserve.engine", "--tp-size", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode != 0
    assert "tp_size 2 cannot split this model's 9 attention heads and 3 KV heads" in r.stderr, r.stderr
    assert "loaded" not in r.stderr  # refused before any rank loaded the model


@pytest.mark.parametrize("args, message", [
    (["--tp-size", "0"], "tp_size must be >= 1"),
    (["--nnodes", "2", "--tp-size", "2"], "nnodes > 1 needs dist_init_addr"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "10.0.0.1:5000"], "tp_size divisible by nnodes"),
    (["--node-rank", "1"], "node_rank must be in [0, nnodes)"),
    (["--tp-size", "2", "--dist-init-addr", "nohost"], "dist_init_addr must be host:port"),
])
def test_bad_parallel_flags(args, message):
    with pytest.raises(ValueError) as e:
        parse_serve_args(args)
    assert message in str(e.value)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_tp_serves_both_disaggregated_modes(mode):
    """TP under PD is accepted: the TP size reaches each server's config."""
    config = parse_serve_args(["--tp-size", "2", "--disaggregation-mode", mode])
    assert config.tp_size == 2 and config.disaggregation_mode == mode


def test_rank_plan_devices_addresses_and_cores():
    config = ServerConfig(engine=EngineConfig(device="cuda"), dp_size=2, tp_size=2, base_gpu_id=1,
                          dist_init_addr="10.0.0.1:5000")
    ranks = plan_ranks(config)
    assert [(r.dp_rank, r.tp_rank, r.device, r.dist_init_addr) for r in ranks] == [
        (0, 0, "cuda:1", "10.0.0.1:5000"), (0, 1, "cuda:2", "10.0.0.1:5000"),
        (1, 0, "cuda:3", "10.0.0.1:5001"), (1, 1, "cuda:4", "10.0.0.1:5001"),
    ]
    one_node = plan_ranks(ServerConfig(tp_size=2))
    assert one_node[0].dist_init_addr == one_node[1].dist_init_addr != ""  # one free local port per DP rank
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # each TP process on its own cores, together all of the server's
        assert sorted(c for r in one_node for c in r.cpus) == cpus
        assert all(r.num_threads == len(r.cpus) for r in one_node)
    # a node > 0 of a two-node DP rank runs the upper TP ranks
    node1 = ServerConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert [r.tp_rank for r in plan_ranks(node1)] == [2, 3]


def test_launch_passes_tp_sizes():
    specs = plan(LaunchConfig(prefill_tp_size=2, decode_tp_size=3, port=0))
    tp = {s.name: s.argv[s.argv.index("--tp-size") + 1] for s in specs[:2]}
    assert tp == {"prefill-0": "2", "decode-0": "3"}
    # each server accepts the TP size launch gives it, under PD too
    for s in specs[:2]:
        config = parse_serve_args(list(s.argv[3:]))
        assert (config.disaggregation_mode, config.tp_size) == (s.name.split("-")[0], int(tp[s.name]))
