"""The SLA planner against static clusters on the daily trace, in one invocation.

Replays the trace (scripts/gen_planner_trace.py's, generated here with the same seed, or --trace)
in the simulator (entrypoints/planner/simulator.py) against servers modelled by a measured profile:

1. the planner in the loop, once per predictor (constant, moving_average, peak);
2. the static cluster sized for the peak: the scaling rule's counts at the trace's highest
   60-second arrival rate (the burst included) and its mean lengths;
3. every static cluster of the planner's cost or less (p + d servers = floor(planner's
   server-seconds / duration)): the best of them by attainment; and, for context, the best with
   one server more (which costs more than the planner).

Target: attainment >= 95% with <= 0.7x the server-seconds of (2), and more attainment than (3).
Writes a PNG and ends with one JSON line.

    python scripts/bench_planner.py --profile results/planner_profile_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gen_planner_trace import add_shape_flags, shape_from  # noqa: E402

from pdserve.entrypoints.planner import profile as prof  # noqa: E402
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel  # noqa: E402
from pdserve.entrypoints.planner.plots import plot_runs  # noqa: E402
from pdserve.entrypoints.planner.predictor import PREDICTORS  # noqa: E402
from pdserve.entrypoints.planner.scaling import Counts, Limits, Load, Slo, decide  # noqa: E402
from pdserve.entrypoints.planner.simulator import SimConfig, simulate  # noqa: E402
from pdserve.entrypoints.planner.sla_planner import SlaPlanner  # noqa: E402
from pdserve.entrypoints.planner.trace import daily_trace, read_csv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROFILE = os.path.join(HERE, "..", "results", "planner_profile_smollm2_cpu.json")


def peak_rate(trace, window: float = 60.0) -> float:
    counts: dict[int, int] = {}
    for r in trace:
        k = int(r.arrival_s // window)
        counts[k] = counts.get(k, 0) + 1
    return max(counts.values()) / window


def summary(r) -> dict:
    return {"attainment": round(r.attainment, 4), "ttft_attainment": round(r.ttft_attainment, 4),
            "itl_attainment": round(r.itl_attainment, 4), "server_seconds": round(r.server_seconds)}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--trace", default=None, help="a trace CSV instead of the generated one")
    add_shape_flags(p)
    p.add_argument("--ttft-slo", type=float, default=4.0)
    p.add_argument("--itl-slo", type=float, default=0.15)
    p.add_argument("--interval", type=float, default=15.0, help="the planner's --adjustment-interval")
    p.add_argument("--startup", type=float, default=30.0, help="seconds from asking for a server to its serving")
    p.add_argument("--cooldown", type=float, default=60.0)
    p.add_argument("--window", type=int, default=4, help="the predictors' window (intervals)")
    p.add_argument("--max-servers", type=int, default=32, help="per role")
    p.add_argument("--default-predictor", default="peak", choices=PREDICTORS)
    p.add_argument("--out-dir", default="/tmp/bench_planner")
    ns = p.parse_args()
    os.makedirs(ns.out_dir, exist_ok=True)
    t0 = time.time()
    profile = prof.load(ns.profile)
    trace = read_csv(ns.trace) if ns.trace else daily_trace(shape_from(ns))
    duration = ns.duration if not ns.trace else trace[-1].arrival_s
    slo = Slo(ns.ttft_slo, ns.itl_slo)
    cfg = SimConfig(slo=slo, interval_s=ns.interval, startup_s=ns.startup)
    limits = Limits(max_prefill=ns.max_servers, max_decode=ns.max_servers, cooldown_s=ns.cooldown)
    print(f"profile {ns.profile}: {profile.server.model} on {profile.machine.cpu}; trace {len(trace)} requests "
          f"over {duration:g} s; SLO p95 TTFT {slo.ttft_s} s, ITL {slo.itl_s} s", flush=True)

    runs = {}
    for name in PREDICTORS:
        planner = SlaPlanner(profile, profile, slo, limits, Counts(1, 1), predictor=name, window=ns.window)
        runs[f"planner ({name})"] = r = simulate(trace, profile, profile, cfg, planner=planner)
        print(f"planner {name:<15} {json.dumps(summary(r))}", flush=True)
    best_planner = runs[f"planner ({ns.default_predictor})"]

    mean_in = sum(r.input_len for r in trace) / len(trace)
    mean_out = sum(r.output_len for r in trace) / len(trace)
    peak = decide(PrefillModel(profile), DecodeModel(profile), Load(peak_rate(trace), mean_in, mean_out), slo,
                  Limits(max_prefill=256, max_decode=256), Counts(1, 1), (math.inf, math.inf)).counts
    static_peak = simulate(trace, profile, profile, cfg, static=peak)
    print(f"static for the peak {peak.prefill}+{peak.decode} {json.dumps(summary(static_peak))}", flush=True)

    n = int(best_planner.server_seconds // best_planner.duration_s)

    def best_of(total: int):
        runs_n = {Counts(pf, total - pf): simulate(trace, profile, profile, cfg, static=Counts(pf, total - pf))
                  for pf in range(1, total)}
        return max(runs_n.items(), key=lambda kv: kv[1].attainment) if runs_n else (None, None)

    best_c, best_static = best_of(n)
    if best_static is not None:
        print(f"best static of {n} servers: {best_c.prefill}+{best_c.decode} {json.dumps(summary(best_static))}",
              flush=True)
    # for context: one server more than the planner's mean (it costs more than the planner)
    up_c, up_static = best_of(n + 1)
    print(f"best static of {n + 1} servers: {up_c.prefill}+{up_c.decode} {json.dumps(summary(up_static))}",
          flush=True)

    plot = os.path.join(ns.out_dir, "bench_planner.png")
    shown = {f"planner ({ns.default_predictor})": best_planner, f"static {peak.prefill}+{peak.decode} (peak)": static_peak}
    if best_static is not None:
        shown[f"static {best_c.prefill}+{best_c.decode} (same cost)"] = best_static
    plot_runs(shown, plot, f"planner vs static clusters: {profile.server.model}, SLO p95 TTFT {slo.ttft_s} s, "
                           f"ITL {slo.itl_s} s, startup {ns.startup:g} s, interval {ns.interval:g} s")
    ratio = best_planner.server_seconds / static_peak.server_seconds
    ok = (best_planner.attainment >= 0.95 and ratio <= 0.7
          and (best_static is None or best_planner.attainment > best_static.attainment))
    line = {"bench": "planner", "predictor": ns.default_predictor, "planner": summary(best_planner),
            "planners": {k: summary(v) for k, v in runs.items()},
            "static_peak": {"prefill": peak.prefill, "decode": peak.decode, **summary(static_peak)},
            "server_seconds_ratio": round(ratio, 3),
            "best_same_cost_static": ({"prefill": best_c.prefill, "decode": best_c.decode, **summary(best_static)}
                                      if best_static else None),
            "best_static_one_more": {"prefill": up_c.prefill, "decode": up_c.decode, **summary(up_static)},
            "target_met": ok, "requests": len(trace), "duration_s": duration, "plot": plot,
            "profile": os.path.basename(ns.profile), "seed": ns.seed, "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(line))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
