"""``pdserve launch --planner`` on real servers: one stand, two checks.

1. ``plan`` against a real run: a profile measured in the test through the cluster's router (the
   PD path: prefill, KV transfer, the decode server's first step, the router), then a Poisson load
   of one configuration (1 prefill + 1 decode, fixed lengths, low utilisation); the advisor's
   predicted median TTFT and mean ITL must be within ``TTFT_BOUND`` / ``ITL_BOUND`` of the run's
   (docs/PLANNER.md, "How close `plan` is": why these bounds).
2. The planner with the ``local`` connector, started by launch itself: under a rising load it
   starts a second decode server, which the router sends requests to; when the load stops it
   drains and stops it; no request fails across both transitions.

One launch: every server start here is a model load. The planner's profile is a synthetic one
with round numbers (low rate: one decode server, high rate: two), so its decisions do not depend
on this machine's speed; hence ``--skip-profile-check``, and ``--no-correction``: corrected by the
servers' latencies, the synthetic profile would plan for this machine's real speed (one decode
server at the high rate on a fast one).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import warnings

import aiohttp
import pytest

from pdserve.entrypoints.procs import free_port, get_json, log_tail, spawn, stop_group
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.profiler import TOKEN_ID_RANGE, ProfilePlan, measure, measure_ttft, stream_times
from pdserve.entrypoints.planner.scaling import Counts, Limits, Load, Slo, decide, predict_itl, predict_ttft
from pdserve.entrypoints.planner.scrape import parse_worker

SERVE = ("--max-total-tokens", "2048", "--dtype", "float32")
TOKENS = 12
SLO = Slo(ttft_s=100.0, itl_s=0.1)
LOW, HIGH = 0.3, 3.0  # req/s
# plan vs real: the configuration (fixed lengths, Poisson arrivals at the rate that loads the
# prefill server to CHECK_RHO by the profile, so that the machine's speed does not change the
# regime), and the bounds on the relative error predicted / measured - 1
CHECK_ISL, CHECK_RHO, CHECK_REQUESTS = 192, 0.3, 10
CHECK_PLAN = ProfilePlan(input_lens=(64, 256), repeats=3, contexts=(256,), batches=(1, 2), tokens=TOKENS)
TTFT_BOUND, ITL_BOUND = 0.35, 0.35
# the machine's speed must hold still for the check: the prefill points and the single-sequence
# ITL measured again after the run within this of the profile's (a machine shared with other work
# moves 2x in seconds)
STEADY = 0.25


def _profile() -> prof.Profile:
    # decode ITL 0.02 + 0.02 b: at most 4 sequences per server meet 0.1 s
    server = prof.ServerDescription(model="synthetic", dtype="float32", quantization="none", tp_size=1,
                                    page_size=16, chunked_prefill_size=0, num_threads=0, max_total_tokens=2048)
    return prof.new_profile(server, [prof.PrefillPoint(16, 0.05), prof.PrefillPoint(1024, 0.5)],
                            [prof.DecodePoint(b, c, 0.02 + 0.02 * b) for c in (16, 1024) for b in (1, 4, 16)])


async def _client(session: aiohttp.ClientSession, url: str, results: list) -> None:
    # a prompt of its own: the router's cache-aware policy would send one shared prompt to the
    # decode server that holds its prefix, never to the new one
    body = {"text": f"{secrets.token_hex(6)} count from one to twenty:", "stream": True,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}
    try:
        async with session.post(url + "/generate", json=body) as r:
            text = (await r.read()).decode()
            ok = r.status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            results.append((r.status, ok, "" if ok else text[-300:]))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        results.append((0, False, repr(e)))


def _metric(url: str, name: str, labels: str) -> float:
    """One sample of the planner's /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _served(url: str) -> float:
    """Sequences a decode server has finished (its pdserve_requests_finished_total)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return parse_worker(r.read().decode(), "decode").finished


def _itl(times: list[float]) -> float:
    """The mean time between a stream's tokens."""
    return (times[-1] - times[0]) / (len(times) - 1)


async def _plan_vs_real(url: str) -> dict:
    """Profile the cluster through its router, predict one configuration, run it, compare."""
    server, prefill, decode = await measure(url, CHECK_PLAN, seed=1, log=lambda _m: None)
    profile = prof.new_profile(server, prefill, decode, note="through the router of a 1+1 launch")
    rate = CHECK_RHO / PrefillModel(profile).ttft(CHECK_ISL)
    load = Load(rate, CHECK_ISL, TOKENS)
    predicted = {"ttft_p50": predict_ttft(PrefillModel(profile), load, 1, quantile=0.5),
                 "itl_mean": predict_itl(DecodeModel(profile), load, 1)[0]}
    rng = random.Random(2)
    out: list = []

    async def one(session, ids):
        t0 = time.perf_counter()
        times = await stream_times(session, url, ids, TOKENS)
        out.append((times[0] - t0, _itl(times)))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        for _ in range(CHECK_REQUESTS):
            ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(CHECK_ISL)]
            tasks.append(asyncio.ensure_future(one(session, ids)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        again = [statistics.median([await measure_ttft(session, url, n, rng) for _ in range(CHECK_PLAN.repeats)])
                 for n in CHECK_PLAN.input_lens]
        itl_again = statistics.median([_itl(await stream_times(session, url, ids, TOKENS))
                                       for ids in [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(CHECK_ISL)]
                                                   for _ in range(CHECK_PLAN.repeats)]])
    measured = {"ttft_p50": statistics.median(o[0] for o in out), "itl_mean": statistics.mean(o[1] for o in out)}
    error = {k: predicted[k] / measured[k] - 1 for k in predicted}
    solo = min((d for d in decode if d.batch_size == 1), key=lambda d: abs(d.context_len - CHECK_ISL))
    drift = max([abs(a / p.ttft_s - 1) for a, p in zip(again, prefill)] + [abs(itl_again / solo.itl_s - 1)])
    line = {"requests": len(out), "rate": rate, "load_avg_1m": os.getloadavg()[0], "prefill": [(p.input_len, round(p.ttft_s, 4))
            for p in prefill], "decode": [(d.batch_size, round(d.itl_s, 4)) for d in decode],
            "predicted": predicted, "measured": measured, "error": error,
            "prefill_after": again, "itl_after": itl_again, "drift": drift}
    print("plan_vs_real", json.dumps(line))
    return line


@pytest.mark.timeout(900)
async def test_launch_planner_plan_error_and_scaling(tmp_path):
    path = str(tmp_path / "profile.json")
    prof.save(_profile(), path)
    pm, dm = PrefillModel(_profile()), DecodeModel(_profile())
    limits, never = Limits(max_prefill=1, max_decode=2, cooldown_s=3), (1e9, 1e9)
    assert decide(pm, dm, Load(LOW, 8, TOKENS), SLO, limits, Counts(1, 1), never).counts == Counts(1, 1)
    assert decide(pm, dm, Load(HIGH, 8, TOKENS), SLO, limits, Counts(1, 1), never).counts == Counts(1, 2)
    port, planner_port = free_port(), free_port()
    url, planner = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{planner_port}"
    argv = [sys.executable, "-m", "pdserve.entrypoints.cli", "launch", "--prefill", "1", "--decode", "1",
            "--port", str(port), "--log-dir", str(tmp_path), "--cpu-split", "auto", *SERVE, "--planner", "--planner-port", str(planner_port),
            f"--planner-arg=--profile={path}", "--planner-arg=--skip-profile-check", "--planner-arg=--no-correction",
            f"--planner-arg=--ttft-slo={SLO.ttft_s}", f"--planner-arg=--itl-slo={SLO.itl_s}",
            "--planner-arg=--adjustment-interval=2", "--planner-arg=--predictor=constant",
            "--planner-arg=--max-prefill=1", "--planner-arg=--max-decode=2", "--planner-arg=--cooldown=3",
            "--planner-arg=--drain-timeout=60"]
    launch_log = str(tmp_path / "launch.out")
    launch = spawn(argv, launch_log, die_with_parent=True)
    try:
        deadline = time.monotonic() + 600
        while get_json(planner + "/health", timeout=2) is None:  # launch starts the planner once ready
            assert launch.poll() is None, log_tail(launch_log)
            assert time.monotonic() < deadline, log_tail(launch_log)
            await asyncio.sleep(0.5)
        own = [w["url"] for w in get_json(url + "/workers", timeout=5)["decode"]]

        check = await _plan_vs_real(url)
        if check["drift"] <= STEADY:
            for k, bound in (("ttft_p50", TTFT_BOUND), ("itl_mean", ITL_BOUND)):
                assert abs(check["error"][k]) <= bound, (k, check)
        else:  # the machine, not the model: the bound is not checked (the scaling part still is)
            warnings.warn(f"plan vs real not checked: the machine's speed moved {check['drift']:.0%} during it")

        results: list = []
        tasks = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def send(rate: float, until) -> None:
                while not until():
                    tasks.append(asyncio.ensure_future(_client(session, url, results)))
                    await asyncio.sleep(1 / rate)

            # rising load: low, then high until the new decode server has served requests
            t0 = time.monotonic()
            await send(LOW, lambda: time.monotonic() - t0 > 5)
            new: list[str] = []

            def served() -> bool:
                listed = [w["url"] for w in (get_json(url + "/workers", timeout=5) or {}).get("decode", [])]
                new[:] = [u for u in listed if u not in own]
                if not new:
                    assert time.monotonic() - t0 < 600, "no decode server added: " + log_tail(str(tmp_path / "planner.log"))
                    return False
                return get_json(new[0] + "/metrics", timeout=5) is not None and _served(new[0]) >= 3

            await send(HIGH, served)
            assert _metric(planner, "pdserve_planner_target_servers", 'role="decode"') == 2
            # the load stops: the planner drains the new server and stops it once drained
            await asyncio.gather(*tasks)
            deadline = time.monotonic() + 300
            while get_json(new[0] + "/health", timeout=2) is not None:
                assert time.monotonic() < deadline, log_tail(str(tmp_path / "planner.log"))
                await asyncio.sleep(0.5)
        assert [w["url"] for w in get_json(url + "/workers", timeout=5)["decode"]] == own
        failed = [r for r in results if not r[1]]
        assert not failed and len(results) >= 10, failed[:3]
        decisions = get_json(planner + "/decisions", timeout=5)
        assert any(d["target"]["decode"] == 2 for d in decisions)
        assert decisions[-1]["target"]["decode"] == 1
        assert _metric(planner, "pdserve_planner_scale_events_total", 'direction="down"') >= 1
        # SIGTERM: launch stops the planner and every server, its own and the planner's
        launch.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(launch.wait, 60) == 0, log_tail(launch_log)
    finally:
        stop_group(launch)
