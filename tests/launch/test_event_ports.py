"""Servers started together with the same ``--kv-events-config`` get KV event ports of their own."""

from __future__ import annotations

import json

from pdserve.entrypoints.cluster import LaunchConfig, plan
from pdserve.entrypoints.event_ports import with_own_event_ports
from pdserve.engine.kv_events_config import KVEventsConfig

EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv", "replay_endpoint": "tcp://*:5558"})


def config_of(argv) -> KVEventsConfig:
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--kv-events-config":
            return KVEventsConfig.from_json(argv[i + 1])
        if a.startswith("--kv-events-config="):
            return KVEventsConfig.from_json(a.split("=", 1)[1])
    raise AssertionError(f"no --kv-events-config in {argv}")


def port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_launch_gives_every_server_distinct_event_ports():
    specs = plan(LaunchConfig(prefill=2, decode=2, decode_dp_size=2, engine_args=("--kv-events-config", EVENTS)))
    taken = []
    for spec in specs[:-1]:
        cfg = config_of(spec.argv)
        assert cfg.topic == "kv" and cfg.publisher == "zmq"  # the rest of the flag is kept
        assert cfg.endpoint.startswith("tcp://*:") and cfg.replay_endpoint.startswith("tcp://*:")
        dp = 2 if spec.name.startswith("decode") else 1
        for ep in (cfg.endpoint, cfg.replay_endpoint):  # DP rank r binds port + r
            taken += [port(ep) + r for r in range(dp)]
    assert len(taken) == len(set(taken)) == 2 * (2 * 1 + 2 * 2)
    assert 5557 not in taken and 5558 not in taken


def test_other_flags_and_forms_are_kept():
    assert with_own_event_ports(["--page-size", "32"]) == ["--page-size", "32"]
    out = with_own_event_ports(["--kv-events-config=" + json.dumps({"publisher": "zmq"}), "--dp-size", "3"])
    assert out[1:] == ["--dp-size", "3"] and out[0].startswith("--kv-events-config=")
    assert port(config_of(out).endpoint) != 5557  # the default endpoint moves too
    ipc = json.dumps({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"})
    assert config_of(with_own_event_ports(["--kv-events-config", ipc])).endpoint == "ipc:///tmp/kv"
