"""Request traces for the simulator: one request per line, ``arrival_s,input_len,output_len``
(CSV with that header), and the generator of the shipped shape.

``daily_trace`` compresses one day into ``duration_s``: a night trough, a morning rise, an
afternoon peak and an evening fall (a raised cosine with its minimum at 04:00 and maximum at
16:00, sharpened by an exponent), plus a burst (the rate multiplied by ``burst_factor`` for 2% of
the day from 10:00) and a quiet period (the rate cut to 2% of the peak for 4% of the day from
20:00, an upstream pause). Arrivals are a Poisson process of that rate, drawn by thinning; input
and output lengths are log-normal, clipped. Everything comes from one ``numpy`` generator seeded
with ``seed``, so a seed gives the same trace on every machine.
"""

from __future__ import annotations

import csv
import math

import msgspec
import numpy as np


class Request(msgspec.Struct, frozen=True, array_like=True):
    arrival_s: float
    input_len: int
    output_len: int


class TraceShape(msgspec.Struct, frozen=True, kw_only=True):
    duration_s: float = 7200.0  # one compressed day
    peak_rate: float = 2.0  # requests/s at the afternoon peak
    trough_fraction: float = 0.08  # night rate / peak rate
    sharpness: float = 1.5  # exponent of the raised cosine: >1 narrows the peak
    burst_start: float = 10 / 24  # fraction of the day
    burst_length: float = 0.02
    burst_factor: float = 2.5
    quiet_start: float = 20 / 24
    quiet_length: float = 0.04
    quiet_fraction: float = 0.02
    input_mean: float = 300.0
    input_sigma: float = 0.6  # of the log-normal
    input_max: int = 3000
    output_mean: float = 120.0
    output_sigma: float = 0.6
    output_max: int = 512
    seed: int = 0


def rate_at(shape: TraceShape, t: float) -> float:
    """Requests/s at time ``t`` (seconds into the trace)."""
    u = (t / shape.duration_s) % 1.0
    day = 0.5 * (1 - math.cos(2 * math.pi * (u - 4 / 24)))  # 0 at 04:00, 1 at 16:00
    rate = shape.peak_rate * (shape.trough_fraction + (1 - shape.trough_fraction) * day ** shape.sharpness)
    if shape.burst_start <= u < shape.burst_start + shape.burst_length:
        rate *= shape.burst_factor
    if shape.quiet_start <= u < shape.quiet_start + shape.quiet_length:
        rate = shape.peak_rate * shape.quiet_fraction
    return rate


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, hi: int) -> np.ndarray:
    mu = math.log(mean) - sigma ** 2 / 2  # so that the mean before clipping is ``mean``
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, hi).astype(int)


def daily_trace(shape: TraceShape) -> list[Request]:
    rng = np.random.default_rng(shape.seed)
    bound = shape.peak_rate * max(1.0, shape.burst_factor)
    n = rng.poisson(bound * shape.duration_s)
    times = np.sort(rng.uniform(0, shape.duration_s, n))
    keep = rng.uniform(0, bound, n) < np.array([rate_at(shape, t) for t in times])
    times = times[keep]
    isl = _lognormal(rng, shape.input_mean, shape.input_sigma, len(times), shape.input_max)
    osl = _lognormal(rng, shape.output_mean, shape.output_sigma, len(times), shape.output_max)
    return [Request(float(t), int(i), max(2, int(o))) for t, i, o in zip(times, isl, osl)]


def write_csv(trace: list[Request], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("arrival_s", "input_len", "output_len"))
        for r in trace:
            w.writerow((f"{r.arrival_s:.4f}", r.input_len, r.output_len))


def read_csv(path: str) -> list[Request]:
    """The trace in ``path``; ValueError naming the line and column of a bad value."""
    out = []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header != ["arrival_s", "input_len", "output_len"]:
            raise ValueError(f"{path}: the header must be arrival_s,input_len,output_len, got {header}")
        for line, row in enumerate(rows, start=2):
            try:
                r = Request(float(row[0]), int(row[1]), int(row[2]))
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            if r.arrival_s < 0 or r.input_len < 1 or r.output_len < 1:
                raise ValueError(f"{path}:{line}: arrival_s >= 0, input_len and output_len >= 1, got {row}")
            out.append(r)
    out.sort(key=lambda r: r.arrival_s)
    return out
