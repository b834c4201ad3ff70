"""PNG plots of benchmark runs: CDFs of TTFT and TPOT (several runs overlaid)
and a per-request timeline of one run. Reads the per-request arrays of
``run_benchmark``'s result (``ttfts``, ``tpots``, ``start_times``, ...)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(x, y, where="post", label=f"{label} (n={len(x)})")


def plot_cdf(runs: dict[str, dict], key: str, title: str, path: str) -> str:
    """CDF of ``run[key]`` (seconds; None entries skipped) for each labelled run."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, run in runs.items():
        _cdf(ax, [v * 1000.0 for v in run.get(key, []) if v is not None], label)
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"CDF of {title}")
    if runs:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(run: dict, path: str, title: str = "") -> str:
    """One bar per request (by start time): waiting for the first token, then streaming.
    Failed requests are drawn in red over their whole life."""
    starts = run.get("start_times", [])
    ttfts = run.get("ttfts", [])
    e2es = run.get("e2e_latencies", [])
    errors = run.get("errors", [""] * len(starts))
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    fig, ax = plt.subplots(figsize=(8, max(3.0, min(12.0, 0.12 * len(order) + 2))))
    for row, i in enumerate(order):
        s, e = starts[i], e2es[i]
        if errors[i]:
            ax.barh(row, e, left=s, color="tab:red", height=0.8)
            continue
        ax.barh(row, ttfts[i], left=s, color="tab:orange", height=0.8)
        ax.barh(row, e - ttfts[i], left=s + ttfts[i], color="tab:blue", height=0.8)
    handles = [Patch(color="tab:orange", label="waiting for first token"), Patch(color="tab:blue", label="streaming")]
    if any(errors):
        handles.append(Patch(color="tab:red", label="failed"))
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("request (by start)")
    ax.set_title(title or "request timeline")
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run: dict, out_dir: str, label: str = "run") -> list[str]:
    """The three PNGs of one run in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return [
        plot_cdf({label: run}, "ttfts", "TTFT", os.path.join(out_dir, "ttft_cdf.png")),
        plot_cdf({label: run}, "tpots", "TPOT", os.path.join(out_dir, "tpot_cdf.png")),
        plot_timeline(run, os.path.join(out_dir, "timeline.png"), f"request timeline ({label})"),
    ]
