"""PNG plots of a profile and of a simulation (matplotlib, imported only here, only when asked)."""

from __future__ import annotations

from pdserve.entrypoints.planner.profile import Profile


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(profile: Profile, path: str) -> str:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([p.input_len for p in profile.prefill], [p.ttft_s * 1000 for p in profile.prefill], "o-")
    a.set_xlabel("input length (tokens)")
    a.set_ylabel("TTFT (ms)")
    a.set_title("prefill")
    for c in sorted({d.context_len for d in profile.decode}):
        pts = [d for d in profile.decode if d.context_len == c]
        b.plot([d.batch_size for d in pts], [d.itl_s * 1000 for d in pts], "o-", label=f"context {c}")
    b.set_xlabel("batch size (sequences)")
    b.set_ylabel("ITL (ms)")
    b.set_title("decode")
    b.legend()
    s = profile.server
    fig.suptitle(f"{s.model} dtype={s.dtype} quant={s.quantization} tp={s.tp_size} threads={s.num_threads or 'default'}"
                 f" on {profile.machine.cpu} ({profile.machine.cores} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_runs(runs: dict, path: str, title: str) -> str:
    """``runs``: label -> SimResult; rate, servers and per-interval SLO attainment over time."""
    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    first = next(iter(runs.values()))
    a.plot([s.t for s in first.samples], [s.rate for s in first.samples], color="gray")
    a.set_ylabel("arrivals (req/s)")
    a.set_title(title, fontsize=9)
    for label, r in runs.items():
        t = [s.t for s in r.samples]
        b.plot(t, [s.cost for s in r.samples], label=f"{label}: {r.server_seconds:.0f} server-s")
        c.plot(t, [s.attainment for s in r.samples], label=f"{label}: {r.attainment:.1%}", lw=0.8)
    b.set_ylabel("servers")
    b.legend(fontsize=7)
    c.set_ylabel("SLO attainment\n(per interval)")
    c.set_xlabel("time (s)")
    c.set_ylim(-0.02, 1.02)
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
