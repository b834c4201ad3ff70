"""What the planner reads each interval: the router's ``/metrics`` and ``/workers``, and the
``/metrics`` of each worker in rotation, reduced to one ``Snapshot`` of cumulative counters and
current gauges; two snapshots make an ``Observation`` (entrypoints/planner/sla_planner.py).

From the router: finished requests (``pdserve_router_requests_total`` of the inference routes),
TTFT (``pdserve_router_ttft_seconds``), the requests in flight on each worker
(``pdserve_router_worker_in_flight``), and which workers are healthy and not draining
(``/workers``). The router has no token counts, so from the workers: prompt tokens per finished
sequence on the prefill servers, generated tokens per finished sequence, ITL
(``pdserve_time_per_output_token_seconds``) and running sequences on the decode servers, waiting
prompts on the prefill servers. Arrivals = finished + the change of the requests in flight.

A worker's counters are differenced only against its own previous values; one that went down
(a restart) counts from zero.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from pdserve.entrypoints.planner.sla_planner import Observation

INFERENCE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


class ScrapeError(RuntimeError):
    """The router or its answer could not be read."""


class WorkerSample(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    finished: float = 0.0  # pdserve_requests_finished_total, all reasons
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    running: float = 0.0  # pdserve_num_running_reqs, all ranks
    waiting: float = 0.0  # pdserve_num_waiting_reqs, all ranks


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    time: float
    finished: float  # router: inference requests answered
    ttft_sum: float
    ttft_count: float
    in_flight: float  # router: requests in flight on the decode workers (each request has one decode leg)
    serving: dict[str, int]  # role -> workers healthy and not draining
    workers: dict[str, WorkerSample]  # url -> sample


def _samples(text: str):
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


def parse_router(text: str) -> tuple[float, float, float, dict[str, float]]:
    """(finished, ttft sum, ttft count, in flight per worker url)."""
    finished = ttft_sum = ttft_count = 0.0
    in_flight: dict[str, float] = {}
    for name, labels, value in _samples(text):
        if name == "pdserve_router_requests_total" and labels.get("route") in INFERENCE_ROUTES:
            finished += value
        elif name == "pdserve_router_ttft_seconds_sum":
            ttft_sum += value
        elif name == "pdserve_router_ttft_seconds_count":
            ttft_count += value
        elif name == "pdserve_router_worker_in_flight" and labels.get("role") == "decode":
            in_flight[labels.get("worker", "")] = value
    return finished, ttft_sum, ttft_count, in_flight


def parse_worker(text: str, role: str) -> WorkerSample:
    v = dict(finished=0.0, prompt_tokens=0.0, generation_tokens=0.0, tpot_sum=0.0, tpot_count=0.0, running=0.0,
             waiting=0.0)
    names = {"pdserve_requests_finished_total": "finished", "pdserve_prompt_tokens_total": "prompt_tokens",
             "pdserve_generation_tokens_total": "generation_tokens",
             "pdserve_time_per_output_token_seconds_sum": "tpot_sum",
             "pdserve_time_per_output_token_seconds_count": "tpot_count",
             "pdserve_num_running_reqs": "running", "pdserve_num_waiting_reqs": "waiting"}
    for name, _, value in _samples(text):
        key = names.get(name)
        if key is not None:
            v[key] += value
    return WorkerSample(role=role, **v)


def _get(url: str, timeout: float, headers: dict[str, str]) -> bytes:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def scrape(router: str, timeout: float = 5.0, api_key: str | None = None) -> Snapshot:
    """One snapshot; ScrapeError when the router does not answer or answers nonsense (a worker
    that does not answer is left out of this snapshot)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    now = time.monotonic()
    try:
        text = _get(router + "/metrics", timeout, headers).decode()
        listing = json.loads(_get(router + "/workers", timeout, headers))
        finished, ttft_sum, ttft_count, in_flight = parse_router(text)
    except (urllib.error.URLError, OSError, ValueError, UnicodeDecodeError) as e:
        raise ScrapeError(f"{router}: {type(e).__name__}: {e}") from None
    if not isinstance(listing, dict):
        raise ScrapeError(f"{router}/workers: not a JSON object")
    serving = {}
    workers = {}
    for role in ("prefill", "decode"):
        entries = [w for w in listing.get(role) or [] if isinstance(w, dict) and isinstance(w.get("url"), str)]
        serving[role] = sum(1 for w in entries if w.get("healthy") and not w.get("draining"))
        for w in entries:
            if not w.get("healthy"):
                continue
            try:
                workers[w["url"]] = parse_worker(_get(w["url"] + "/metrics", timeout, headers).decode(), role)
            except (urllib.error.URLError, OSError, ValueError, UnicodeDecodeError):
                continue
    return Snapshot(time=now, finished=finished, ttft_sum=ttft_sum, ttft_count=ttft_count,
                    in_flight=sum(in_flight.values()), serving=serving, workers=workers)


def _delta(new: float, old: float | None) -> float:
    """A counter's increase; a counter that went down restarted from zero."""
    if old is None or new < old:
        return new
    return new - old


def observe(prev: Snapshot, cur: Snapshot) -> Observation:
    """The interval between two snapshots. The router's own counters are differenced as they
    are (a negative rate, from a router restart, is nonsense the planner refuses)."""
    dt = cur.time - prev.time
    finished = cur.finished - prev.finished
    arrivals = finished + (cur.in_flight - prev.in_flight)
    n_ttft = cur.ttft_count - prev.ttft_count
    sums = {"pre_fin": 0.0, "prompt": 0.0, "dec_fin": 0.0, "gen": 0.0, "tpot_sum": 0.0, "tpot_n": 0.0}
    running, waiting, decoders = 0.0, 0.0, 0
    for url, w in cur.workers.items():
        old = prev.workers.get(url)
        if w.role == "prefill":
            sums["pre_fin"] += _delta(w.finished, old.finished if old else None)
            sums["prompt"] += _delta(w.prompt_tokens, old.prompt_tokens if old else None)
            waiting += w.waiting
        else:
            sums["dec_fin"] += _delta(w.finished, old.finished if old else None)
            sums["gen"] += _delta(w.generation_tokens, old.generation_tokens if old else None)
            sums["tpot_sum"] += _delta(w.tpot_sum, old.tpot_sum if old else None)
            sums["tpot_n"] += _delta(w.tpot_count, old.tpot_count if old else None)
            running += w.running
            decoders += 1
    return Observation(
        interval_s=dt, rate=arrivals / dt if dt > 0 else 0.0,
        input_len=sums["prompt"] / sums["pre_fin"] if sums["pre_fin"] else None,
        output_len=sums["gen"] / sums["dec_fin"] if sums["dec_fin"] else None,
        ttft_s=(cur.ttft_sum - prev.ttft_sum) / n_ttft if n_ttft > 0 else None,
        itl_s=sums["tpot_sum"] / sums["tpot_n"] if sums["tpot_n"] else None,
        prefill_servers=float(cur.serving.get("prefill", 0)), decode_servers=float(cur.serving.get("decode", 0)),
        decode_batch=running / decoders if decoders and running else None,
        prefill_queue=waiting)
