from __future__ import annotations

import pytest

from pdserve.kvtransfer import AuxData, AuxPool, KVTransferConfig


def test_aux_round_trip_and_slots():
    pool = AuxPool(3, max_top_logprobs=4)
    a, b = pool.alloc(), pool.alloc()
    assert a != b and pool.num_free == 1
    assert pool.read(a) is None  # never written: invalid, not token 0
    aux = AuxData(49151, -0.5, [1, 2, 3], [-0.5, -1.0, -2.0], cached_tokens=4096)
    pool.write(a, aux)
    assert pool.read(a) == aux
    assert pool.read(b) is None
    assert pool.slot_addr(1) - pool.slot_addr(0) == pool.slot_bytes
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)
    with pytest.raises(ValueError):
        pool.write(b, AuxData(1, 0.0, [1] * 5, [0.0] * 5))
    assert pool.alloc() == a and pool.read(a) is None  # a reused slot is cleared


def test_aux_pool_exhaustion():
    pool = AuxPool(1)
    assert pool.alloc() == 0
    assert pool.alloc() is None


def test_config_defaults_and_validation():
    cfg = KVTransferConfig()
    assert (cfg.bootstrap_timeout, cfg.heartbeat_interval, cfg.heartbeat_max_failures) == (300.0, 5.0, 2)
    assert cfg.protocol == "tcp" and cfg.heartbeat_window == 10.0
    assert KVTransferConfig(ib_device="mlx5_0").protocol == "rdma"
    with pytest.raises(AttributeError):
        cfg.backend = "nixl"  # frozen
    for bad in ({"backend": "gloo"}, {"heartbeat_interval": 0}, {"heartbeat_max_failures": 0},
                {"waiting_timeout": -1}, {"host": ""}, {"control_port": 70000}):
        with pytest.raises(ValueError):
            KVTransferConfig(**bad)


def test_serve_cli_kv_flags_come_from_kvtransferconfig():
    from pdserve.entrypoints.flags import KV_FLAGS, build_serve_parser, parse_serve_args

    ns = build_serve_parser().parse_args([])
    cfg = KVTransferConfig()
    assert all(getattr(ns, dest) == getattr(cfg, name) for name, dest in KV_FLAGS.items())
    assert ns.disaggregation_bootstrap_port == 8998
    c = parse_serve_args(["--disaggregation-bootstrap-port", "9001", "--disaggregation-transfer-backend", "nixl",
                          "--disaggregation-waiting-timeout", "7", "--disaggregation-ib-device", "mlx5_0"])
    kv = c.kv_transfer_config()
    assert (kv.bootstrap_port, kv.backend, kv.waiting_timeout, kv.protocol) == (9001, "nixl", 7.0, "rdma")
    for bad in (["--disaggregation-transfer-backend", "gloo"], ["--disaggregation-heartbeat-interval", "0"]):
        with pytest.raises(SystemExit):  # a usage error before anything starts
            parse_serve_args(bad)


def test_import_is_light():
    """``import pdserve.kvtransfer`` (and its config) pulls neither torch nor a backend library."""
    import subprocess
    import sys

    code = ("import sys, pdserve.kvtransfer, pdserve.engine.kv_transfer_config, pdserve.engine.server_config; "
            "print(sorted(m for m in ('torch', 'zmq', 'mooncake', 'nixl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
