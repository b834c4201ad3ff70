"""``pdserve profile``, ``pdserve plan`` and ``pdserve planner``: the planner's commands.

    pdserve profile --mode short --output prof.json --plot prof.png --cpus 0 [serve flags]
    pdserve profile --url http://127.0.0.1:30000 --output prof.json      # a server already running
    pdserve plan --profile prof.json --rate 2 --input-len 600 --output-len 120 --ttft-slo 2 --itl-slo 0.1
    pdserve planner --router http://127.0.0.1:8000 --profile prof.json --connector local ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable

from pdserve.entrypoints.flags import check_serve_flags
from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_group, wait_healthy
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.profiler import FULL, SHORT, measure


def _cpus(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


# --- profile ------------------------------------------------------------------------------------

def build_profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve profile", allow_abbrev=False,
                                description="Measure prefill TTFT vs input length and decode ITL vs batch and "
                                            "context on a real server; write the profile (JSON) and a plot (PNG). "
                                            "Other flags go to the `pdserve serve` it starts.")
    p.add_argument("--url", default=None, help="measure this running server instead of starting one")
    p.add_argument("--mode", choices=("short", "full"), default="short",
                   help="short: 4 input lengths, 2 contexts x 3 batches (a few minutes here); full: 7 x 4 x 6")
    p.add_argument("--output", default="profile.json", help="the profile (default: %(default)s)")
    p.add_argument("--plot", default=None, help="PNG of the profile (default: the output with .png)")
    p.add_argument("--cpus", default=None, help="cores of the server it starts, e.g. 0-3 (its share of a CPU "
                                                "split); default: all")
    p.add_argument("--seed", type=int, default=0, help="seeds the random prompts (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p


def profile_main(argv: list[str], build_serve_parser: Callable[[], argparse.ArgumentParser]) -> int:
    parser = build_profile_parser()
    ns, serve_args = parser.parse_known_args(argv)
    if ns.url and serve_args:
        parser.error(f"with --url no server is started: {serve_args} would be ignored")
    if serve_args:
        check_serve_flags(serve_args, build_serve_parser, "pdserve profile (flags of the server it starts)")
        for flag in ("--host", "--port", "--disaggregation-mode"):
            if any(a.split("=")[0] == flag for a in serve_args):
                parser.error(f"{flag} is set by profile itself")
    try:
        cpus = _cpus(ns.cpus) if ns.cpus else None
    except ValueError:
        parser.error(f"--cpus: expected e.g. 0-3 or 0,2, got {ns.cpus!r}")
    plan = SHORT if ns.mode == "short" else FULL
    proc = None
    url = ns.url
    if url is None:
        port = free_port()
        log_path = os.path.splitext(ns.output)[0] + ".server.log"
        argv_s = [sys.executable, "-m", "pdserve.engine", "--host", "127.0.0.1", "--port", str(port), *serve_args]
        if cpus and "--num-threads" not in serve_args:
            argv_s += ["--num-threads", str(len(cpus))]
        proc = spawn(argv_s, log_path, cpus=cpus, die_with_parent=True)
        url = f"http://127.0.0.1:{port}"
        print(f"[profile] starting a server at {url} (log {log_path})", flush=True)
        try:
            wait_healthy(url, proc, ns.startup_timeout, name="the server", log=lambda: log_tail(log_path))
        except (RuntimeError, TimeoutError) as e:
            print(f"pdserve profile: error: {e}", file=sys.stderr)
            stop_group(proc)
            return 1
    try:
        server, prefill, decode = asyncio.run(measure(url, plan, ns.seed))
    except Exception as e:  # noqa: BLE001 - any failure of the measurement is reported, the server stopped
        print(f"pdserve profile: error: measuring {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_group(proc)
    note = f"pdserve profile --mode {ns.mode}" + (f" --cpus {ns.cpus}" if ns.cpus else "") + \
        (f" {' '.join(serve_args)}" if serve_args else "")
    profile = prof.new_profile(server, prefill, decode, note=note)
    prof.save(profile, ns.output)
    from pdserve.entrypoints.planner.plots import plot_profile

    png = plot_profile(profile, ns.plot or os.path.splitext(ns.output)[0] + ".png")
    print(f"[profile] wrote {ns.output} and {png}", flush=True)
    return 0


# --- plan ---------------------------------------------------------------------------------------

def build_plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", allow_abbrev=False,
                                description="Recommend prefill and decode counts (and the profile, e.g. TP size, "
                                            "per role) for a traffic and SLOs, from measured profiles.")
    p.add_argument("--profile", action="append", required=True, metavar="JSON",
                   help="a profile (repeatable: one per server configuration, e.g. TP size)")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--input-len", type=float, required=True, help="mean prompt tokens")
    p.add_argument("--output-len", type=float, required=True, help="mean generated tokens")
    p.add_argument("--prefix-reuse", type=float, default=0.0,
                   help="share of prompt tokens served from the prefix cache (default: %(default)s)")
    p.add_argument("--ttft-slo", type=float, required=True, help="seconds")
    p.add_argument("--itl-slo", type=float, required=True, help="seconds")
    p.add_argument("--slo-quantile", type=float, default=0.95,
                   help="the share of requests that must meet both SLOs (default: %(default)s)")
    p.add_argument("--max-servers", type=int, default=64, help="per pool (default: %(default)s)")
    p.add_argument("--alternatives", type=int, default=4, help="options shown after the best (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    return p


def plan_main(argv: list[str]) -> int:
    from pdserve.entrypoints.planner.advisor import Traffic, advise, verdict
    from pdserve.entrypoints.planner.scaling import Slo

    parser = build_plan_parser()
    ns = parser.parse_args(argv)
    try:
        profiles = {os.path.basename(path): prof.load(path) for path in ns.profile}
        models = {p.server.model for p in profiles.values()}
        if len(models) > 1:
            raise ValueError(f"--profile: the profiles are of different models: {sorted(models)}")
        traffic = Traffic(rate=ns.rate, input_len=ns.input_len, output_len=ns.output_len,
                          prefix_reuse=ns.prefix_reuse)
        slo = Slo(ns.ttft_slo, ns.itl_slo, ns.slo_quantile)
    except (ValueError, OSError) as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    options = advise(profiles, traffic, slo, ns.max_servers)
    shown = options[:1 + ns.alternatives]
    line = {"verdict": verdict(options), "best": _option_json(options[0]),
            "alternatives": [_option_json(o) for o in shown[1:]]}
    if not ns.json:
        print(f"traffic {ns.rate:g} req/s, input {ns.input_len:g}, output {ns.output_len:g} tokens, prefix reuse "
              f"{ns.prefix_reuse:g}; SLO p{ns.slo_quantile * 100:g} TTFT {ns.ttft_slo:g} s, ITL {ns.itl_slo:g} s")
        names = {n: f"P{i}" for i, n in enumerate(profiles)}
        for n, short in names.items():
            print(f"  {short} = {n}")
        print(f"{'kind':<14}{'prefill':>9}{'decode':>9}{'TTFT s':>9}{'ITL ms':>9}{'goodput':>9}{'cost':>7}  meets")
        for o in shown:
            pre = f"{o.prefill}x{names[o.prefill_profile]}" if o.kind == "disaggregated" else "-"
            print(f"{o.kind:<14}{pre:>9}{f'{o.decode}x{names[o.decode_profile]}':>9}{o.ttft_s:>9.3f}"
                  f"{o.itl_s * 1000:>9.1f}{o.goodput_rps:>9.2f}{o.cost:>7g}  {'yes' if o.meets_slo else 'no'}")
        print("(colocated: its servers in the decode column; TTFT at the SLO quantile; goodput in req/s)")
        print(line["verdict"])
    print(json.dumps(line))
    return 0


def _option_json(o) -> dict:
    import msgspec

    d = msgspec.to_builtins(o)
    return {k: (round(v, 4) if isinstance(v, float) and v != float("inf") else v) for k, v in d.items()}


# --- planner ------------------------------------------------------------------------------------

_PLANNER_HELP = {
    "router": "the router whose /metrics and /workers are read",
    "admin_api_key": "the router's --admin-api-key (adds, drains, removes workers); default: PDSERVE_ROUTER_ADMIN_API_KEY",
    "profile": "profile (pdserve profile) of both roles' servers",
    "ttft_slo": "seconds, met by --slo-quantile of the requests",
    "itl_slo": "seconds, mean per request, met by --slo-quantile of the requests",
    "adjustment_interval": "seconds between decisions",
    "predictor": "next interval's load: constant (last), moving_average, peak (max of the window)",
    "predictor_window": "intervals the moving_average and peak predictors look back",
    "cooldown": "seconds after a role's change before it may scale down (scale-up never waits)",
    "budget": "the most cost (servers x TP size) both pools may take together",
    "max_utilization": "the highest load a server is planned at",
    "connector": "virtual: record decisions only; local: servers on this machine; kubernetes: deploy/k8s",
    "port": "the planner's own /metrics, /decisions, /health (0: a free port)",
    "skip_profile_check": "use the profiles even when the servers' configuration differs",
    "correction": "correct the profiles by the servers' observed latencies (--no-correction: the profiles alone)",
    "leave_servers": "local: at exit leave the servers the planner started running",
    "drain_timeout": "seconds a server scaled down gets to finish its requests",
    "router_pods": "kubernetes: URL naming every router replica (a headless Service)",
    "planner_http_header_timeout": "seconds a connection to the planner's port may go without a whole request head",
    "planner_max_connections": "open connections the planner's port keeps; more are answered 503",
}
# the planner's own listener limits: prefixed, since --http-header-timeout and --max-connections
# without it are serve flags that the local connector passes on
_PLANNER_DESTS = {"http_header_timeout": "planner_http_header_timeout", "max_connections": "planner_max_connections"}


def build_planner_parser() -> argparse.ArgumentParser:
    import dataclasses

    from pdserve.entrypoints.flags import add_dataclass_flags
    from pdserve.entrypoints.planner.connector import CONNECTORS
    from pdserve.entrypoints.planner.planner_config import PlannerConfig
    from pdserve.entrypoints.planner.predictor import PREDICTORS

    p = argparse.ArgumentParser(prog="pdserve planner", allow_abbrev=False,
                                description="Scale the prefill and decode pools to the SLOs. With --connector local, "
                                            "other flags go to the `pdserve serve` of each server it starts.")
    add_dataclass_flags(p, PlannerConfig, [f.name for f in dataclasses.fields(PlannerConfig) if f.name != "serve_args"],
                        dests=_PLANNER_DESTS, helps=_PLANNER_HELP, choices={"connector": list(CONNECTORS), "predictor": list(PREDICTORS)})
    return p


def planner_values(ns: argparse.Namespace) -> dict:
    """The planner parser's values by PlannerConfig field (the prefixed flags renamed back)."""
    values = dict(vars(ns))
    for name, dest in _PLANNER_DESTS.items():
        values[name] = values.pop(dest)
    return values


def parse_planner_args(argv: list[str], build_serve_parser: Callable[[], argparse.ArgumentParser]):
    from pdserve.entrypoints.planner.planner_config import PlannerConfig

    parser = build_planner_parser()
    ns, rest = parser.parse_known_args(argv)
    if rest:
        if ns.connector != "local":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        check_serve_flags(rest, build_serve_parser, "pdserve planner (flags of the servers it starts)")
    return PlannerConfig(serve_args=tuple(rest), **planner_values(ns))


def planner_main(argv: list[str], build_serve_parser: Callable[[], argparse.ArgumentParser]) -> int:
    import logging

    from pdserve.entrypoints.planner.planner_process import serve_planner
    from pdserve.entrypoints.planner.profile import ProfileMismatch

    try:
        config = parse_planner_args(argv, build_serve_parser)
    except ValueError as e:
        print(f"pdserve planner: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve_planner(config))
    except (ProfileMismatch, ValueError, OSError) as e:
        print(f"pdserve planner: error: {e}", file=sys.stderr)
        return 2
    return 0
