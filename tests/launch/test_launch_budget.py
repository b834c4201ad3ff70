"""``pdserve launch`` plans one memory budget over every server it starts (each gets its share of
``--mem-fraction-static``) and turns conditional disaggregation on from one flag."""

from __future__ import annotations

import pytest

from pdserve.entrypoints.flags import build_serve_parser
from pdserve.entrypoints.cluster import LaunchConfig, plan
from pdserve.entrypoints.launch_flags import parse_launch_args


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_servers_split_one_budget():
    specs = plan(LaunchConfig(prefill=2, decode=1, prefill_tp_size=3, port=0, mem_fraction_static=0.6))
    servers = specs[:-1]
    shares = [float(_flag(list(s.argv), "--mem-fraction-static")) for s in servers]
    assert shares == pytest.approx([0.2, 0.2, 0.2]) and sum(shares) == pytest.approx(0.6)
    assert _flag(list(specs[-1].argv), "--mem-fraction-static") is None  # the router holds no pool
    assert parse_launch_args(["--mem-fraction-static", "0.3"], build_serve_parser).mem_fraction_static == 0.3


def test_local_prefill_from_one_flag():
    specs = plan(LaunchConfig(prefill=1, decode=2, port=0, local_prefill_max_tokens=256))
    by_name = {s.name: list(s.argv) for s in specs}
    assert _flag(by_name["decode-0"], "--max-local-prefill-tokens") == "256"
    assert _flag(by_name["decode-1"], "--max-local-prefill-tokens") == "256"
    assert _flag(by_name["prefill-0"], "--max-local-prefill-tokens") is None
    assert _flag(by_name["router"], "--local-prefill-max-tokens") == "256"
    off = plan(LaunchConfig(port=0))
    assert all("--max-local-prefill-tokens" not in s.argv and "--local-prefill-max-tokens" not in s.argv for s in off)


@pytest.mark.parametrize("kwargs, message", [
    ({"mem_fraction_static": 0.0}, "--mem-fraction-static must be in (0, 1]"),
    ({"local_prefill_max_tokens": -1}, "--local-prefill-max-tokens must be >= 0"),
    ({"engine_args": ("--max-local-prefill-tokens", "8")}, "use launch's own flags"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        LaunchConfig(**kwargs)
