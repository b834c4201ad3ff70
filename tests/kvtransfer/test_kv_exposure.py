"""Who may reach the KV planes: a PD server on a non-loopback host refuses to start without a key
(unless told the network is trusted); a decode server's bootstrap allowlist refuses other hosts
with a 400 naming the field; KV events bind the server's --host, not every interface."""

from __future__ import annotations

import socket

import pytest
import zmq

from pdserve.entrypoints.cli import serve_main
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.frontend.request_schemas import GenerateRequest
from pdserve.engine.frontend.value_checks import RequestLimits, bootstrap_infos
from pdserve.engine.kv_events_config import KVEventsConfig
from pdserve.engine.mem_cache.kv_event_publisher import ZmqEventPublisher
from pdserve.engine.net_allowlist import host_allowed, parse_allowlist

pytestmark = pytest.mark.timeout(30)

HOST = "198.51.100.7"  # documentation range: never this machine's
BASE = ["--disaggregation-transfer-backend", "local", "--host", HOST]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_server_on_a_public_host_refuses_to_start_without_a_key(mode, capsys, tmp_path):
    assert serve_main([*BASE, "--disaggregation-mode", mode]) == 2
    err = capsys.readouterr().err
    assert "--disaggregation-auth-key-file" in err and "--disaggregation-allow-unauthenticated" in err and HOST in err


def test_placeholder_key_is_refused_at_startup(capsys, tmp_path):
    key = tmp_path / "kv.key"
    key.write_text("replace-me-with-a-random-secret\n")
    with pytest.raises(SystemExit):
        serve_main([*BASE, "--disaggregation-mode", "prefill", "--disaggregation-auth-key-file", str(key)])
    assert "placeholder" in capsys.readouterr().err


def test_exposure_rule():
    from pdserve.engine.kv_transfer_config import KVTransferConfig

    cfg = KVTransferConfig(backend="local")
    for host in ("127.0.0.1", "localhost", "::1"):
        cfg.check_exposure("prefill", host)  # loopback: nothing to expose
    cfg.check_exposure("null", HOST)  # no KV plane
    KVTransferConfig(backend="local", allow_unauthenticated=True).check_exposure("decode", HOST)
    for host in (HOST, "0.0.0.0"):
        with pytest.raises(ValueError, match="not loopback"):
            cfg.check_exposure("decode", host)


def test_bootstrap_allowlist():
    allow = parse_allowlist("prefill-0.pool, 10.1.0.0/16, 192.0.2.5")
    assert host_allowed(allow, "prefill-0.pool") and host_allowed(allow, "10.1.200.3")
    assert host_allowed(allow, "192.0.2.5") and not host_allowed(allow, "192.0.2.6")
    assert not host_allowed(allow, "169.254.169.254") and not host_allowed(allow, "evil.example")
    assert host_allowed(parse_allowlist(""), "anything")
    with pytest.raises(ValueError, match="not a host or a CIDR"):
        parse_allowlist("10.0.0.0/99")

    limits = RequestLimits(frozenset({"m"}), 1, 1, 100, disaggregation_mode="decode",
                           bootstrap_allowlist="10.1.0.0/16")
    ok = GenerateRequest(input_ids=[1], bootstrap_host="10.1.0.9", bootstrap_port=8998, bootstrap_room=1)
    assert bootstrap_infos(ok, 1, 1, limits, None)[0].host == "10.1.0.9"
    bad = GenerateRequest(input_ids=[1], bootstrap_host="169.254.169.254", bootstrap_port=80, bootstrap_room=1)
    with pytest.raises(RequestError, match="not in this server's --disaggregation-bootstrap-allowlist") as e:
        bootstrap_infos(bad, 1, 1, limits, None)
    assert e.value.param == "bootstrap_host"


def _other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # no packet is sent: picks the outgoing interface
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_kv_events_bind_the_server_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"tcp://*:{port}")
    ctx = zmq.Context()
    publisher = ZmqEventPublisher(cfg, dp_rank=0, ctx=ctx, host="127.0.0.1")
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        other = _other_address()
        if other is not None:  # the port is free on the other interface: not bound there
            with socket.socket() as s:
                s.bind((other, port))
    finally:
        publisher.close()
        ctx.term()
