"""Write the planner's benchmark trace as CSV (arrival_s,input_len,output_len).

The shape (entrypoints/planner/trace.py, ``TraceShape``): one day compressed into --duration seconds, a
raised cosine from a night trough (04:00, --trough of the peak) to an afternoon peak (16:00,
--peak-rate req/s), a --burst-factor burst for 2% of the day from 10:00 and a quiet period (2% of
the peak) for 4% of the day from 20:00; Poisson arrivals by thinning; log-normal input (mean 300,
at most 3000) and output (mean 120, at most 512) lengths. One numpy generator seeded with --seed
draws everything: the same seed gives the same file on any machine.

    python scripts/gen_planner_trace.py --out trace.csv            # the benchmark's trace (seed 0)
"""

from __future__ import annotations

import argparse

import msgspec

from pdserve.entrypoints.planner.trace import TraceShape, daily_trace, write_csv

_D = TraceShape()


def add_shape_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=_D.duration_s, help="seconds of the compressed day (default: %(default)s)")
    p.add_argument("--peak-rate", type=float, default=_D.peak_rate, help="req/s at the peak (default: %(default)s)")
    p.add_argument("--trough", type=float, default=_D.trough_fraction, help="night rate / peak (default: %(default)s)")
    p.add_argument("--burst-factor", type=float, default=_D.burst_factor, help="(default: %(default)s)")
    p.add_argument("--input-mean", type=float, default=_D.input_mean, help="(default: %(default)s)")
    p.add_argument("--output-mean", type=float, default=_D.output_mean, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=_D.seed, help="(default: %(default)s)")


def shape_from(ns) -> TraceShape:
    return msgspec.structs.replace(_D, duration_s=ns.duration, peak_rate=ns.peak_rate, trough_fraction=ns.trough,
                                   burst_factor=ns.burst_factor, input_mean=ns.input_mean,
                                   output_mean=ns.output_mean, seed=ns.seed)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add_shape_flags(p)
    p.add_argument("--out", default="planner_trace.csv")
    ns = p.parse_args()
    trace = daily_trace(shape_from(ns))
    write_csv(trace, ns.out)
    print(f"wrote {len(trace)} requests over {ns.duration:g} s to {ns.out}")


if __name__ == "__main__":
    main()
