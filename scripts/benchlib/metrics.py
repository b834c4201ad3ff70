"""Benchmark metrics from per-request timings, named as SGLang's ``bench_serving`` names them.

TTFT: request sent -> first token received. TPOT (per request, the first
token excluded): ``(e2e - ttft) / (output_tokens - 1)``, for requests with
more than one output token. ITL: every gap between token arrivals (a chunk
carrying k tokens counts as k gaps of 1/k its delay). E2E latency: request
sent -> last byte. Each statistic in ms: mean, median, std, p90, p99, max.
Goodput: requests per second that met the TTFT and the TPOT SLO together;
an SLO that is not given is not checked. Failed requests meet no SLO.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STATS = ("mean", "median", "std", "p90", "p99", "max")
LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")


@dataclasses.dataclass
class RequestOutput:
    """What the client saw of one request; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # server's prompt token count where it reports one, else the dataset's
    expected_output_len: int = 0
    output_len: int = 0  # server's completion token count where it reports one, else chunks seen
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    start_time: float = 0.0  # since the benchmark started
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def stats_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    """``{mean_<name>_ms: ..., median_..., std_..., p90_..., p99_..., max_...}``; None when empty."""
    if not values_s:
        return {f"{s}_{name}_ms": None for s in STATS}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    vals = (a.mean(), np.median(a), a.std(), np.percentile(a, 90), np.percentile(a, 99), a.max())
    return {f"{s}_{name}_ms": float(v) for s, v in zip(STATS, vals)}


def meets_slo(o: RequestOutput, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not o.success:
        return False
    if slo_ttft_ms is not None and o.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = o.tpot
    if slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms:
        return False
    return True


def calculate_metrics(
    outputs: list[RequestOutput],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """All summary metrics of one run (``duration`` in seconds, > 0)."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    good = sum(meets_slo(o, slo_ttft_ms, slo_tpot_ms) for o in outputs)
    m: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
    }
    m.update(stats_ms("ttft", [o.ttft for o in ok]))
    m.update(stats_ms("tpot", [t for t in (o.tpot for o in ok) if t is not None]))
    m.update(stats_ms("itl", [g for o in ok for g in o.itl]))
    m.update(stats_ms("e2e_latency", [o.latency for o in ok]))
    # mean number of requests in flight over the run, as SGLang defines it
    m["concurrency"] = sum(o.latency for o in ok) / duration
    m["slo_ttft_ms"] = slo_ttft_ms
    m["slo_tpot_ms"] = slo_tpot_ms
    m["goodput"] = good / duration
    m["slo_attainment"] = good / len(outputs) if outputs else None
    return m


def error_counts(outputs: list[RequestOutput]) -> dict[str, int]:
    """Distinct error messages of the failed requests, most frequent first."""
    counts: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            counts[o.error] = counts.get(o.error, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def format_table(m: dict, title_rows: list[tuple[str, object]]) -> str:
    """The human-readable summary, in the layout of SGLang's client."""

    def fmt(v) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    rows = title_rows + [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", m["duration"]),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", m["request_throughput"]),
        ("Input token throughput (tok/s):", m["input_throughput"]),
        ("Output token throughput (tok/s):", m["output_throughput"]),
        ("Total token throughput (tok/s):", m["total_throughput"]),
        ("Concurrency:", m["concurrency"]),
    ]
    lines += [f"{k:<44}{fmt(v):<14}" for k, v in rows]
    sections = [
        ("e2e_latency", "End-to-End Latency", "E2E Latency"),
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
    ]
    for key, header, label in sections:
        lines.append("{:-^60}".format(header))
        for s in STATS:
            lines.append(f"{f'{s.capitalize()} {label} (ms):':<44}{fmt(m[f'{s}_{key}_ms']):<14}")
    slo = []
    if m["slo_ttft_ms"] is not None:
        slo.append(f"TTFT <= {m['slo_ttft_ms']:g} ms")
    if m["slo_tpot_ms"] is not None:
        slo.append(f"TPOT <= {m['slo_tpot_ms']:g} ms")
    lines.append("{:-^60}".format(" Goodput (" + (" and ".join(slo) or "no SLO given") + ") "))
    lines.append(f"{'Goodput (req/s):':<44}{fmt(m['goodput']):<14}")
    att = m["slo_attainment"]
    lines.append(f"{'SLO attainment (%):':<44}{fmt(None if att is None else 100.0 * att):<14}")
    lines.append("=" * 60)
    return "\n".join(lines)
