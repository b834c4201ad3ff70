"""scripts/bench_serving.py for shared fleets (``--tenants``, ``--tenant-weights``, ``--priority-mix``):
the workload shaping (``benchlib/traffic_mix.py``) as pure logic, what reaches a real socket (the
tenant header, the priority header and body field, per request), the per-group figures, and the
argument errors."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_serving.py"

_spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)  # also puts scripts/ on sys.path for benchlib
from benchlib.datasets import DatasetRow  # noqa: E402
from benchlib.metrics import RequestOutput  # noqa: E402
from benchlib.traffic_mix import (PRIORITY_HEADER, RequestTag, apportion, assign_tags, group_metrics,  # noqa: E402
                                  parse_priority_mix, parse_tenant_weights)

from pdserve.router.request_priority import PRIORITY_HEADER as ROUTER_PRIORITY_HEADER  # noqa: E402


def test_the_priority_header_is_the_routers():
    assert PRIORITY_HEADER == ROUTER_PRIORITY_HEADER


def test_shares_are_apportioned_exactly():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [0.5, 0.25, 0.25]) == [3, 2, 2]  # remainders .5, .75, .75
    assert apportion(100, [8, 1, 1]) == [80, 10, 10]
    assert sum(apportion(13, [0.3, 0.3, 0.4])) == 13


def test_mix_and_weights_are_parsed_or_refused_by_name():
    assert parse_priority_mix("10:0.2, 0:0.8") == [(10, 0.2), (0, 0.8)]
    assert parse_priority_mix("-1:1") == [(-1, 1.0)]
    for bad, msg in (("10", "not PRIORITY:FRACTION"), ("a:0.5,0:0.5", "not PRIORITY:FRACTION"),
                     ("1:0.5,0:0.4", "sum to 1"), ("1:0,0:1", "must be > 0"), ("1:0.5,1:0.5", "given twice")):
        with pytest.raises(ValueError, match=msg):
            parse_priority_mix(bad)
    assert parse_tenant_weights("4,1,1", 3) == [4.0, 1.0, 1.0]
    for bad, msg in (("4,1", "2 weight"), ("4,0,1", "must be > 0"), ("4,x,1", "not a list")):
        with pytest.raises(ValueError, match=msg):
            parse_tenant_weights(bad, 3)


def test_tags_have_exact_counts_and_follow_the_seed():
    tags = assign_tags(20, 3, [2, 1, 1], [(5, 0.25), (0, 0.75)], seed=3)
    assert Counter(t.tenant for t in tags) == {"tenant-0": 10, "tenant-1": 5, "tenant-2": 5}
    assert Counter(t.priority for t in tags) == {5: 5, 0: 15}
    assert assign_tags(20, 3, [2, 1, 1], [(5, 0.25), (0, 0.75)], seed=3) == tags
    assert assign_tags(20, 3, [2, 1, 1], [(5, 0.25), (0, 0.75)], seed=4) != tags
    # the two dimensions are independent: high priorities are not all one tenant's
    assert len({t.tenant for t in tags if t.priority == 5}) > 1
    assert assign_tags(4) == [RequestTag()] * 4
    assert RequestTag().headers("x-tenant") == {} and RequestTag().body() == {}
    assert RequestTag("tenant-1", 3).headers("x-team") == {"x-team": "tenant-1", PRIORITY_HEADER: "3"}
    assert RequestTag("tenant-1", 3).body() == {"priority": 3}


def _out(ttft: float, ok: bool = True) -> RequestOutput:
    return RequestOutput(success=ok, prompt_len=4, expected_output_len=3, output_len=3 if ok else 0, ttft=ttft,
                         latency=ttft + 0.2)


def test_group_figures_per_tenant_and_priority():
    outputs = [_out(0.1), _out(0.3), _out(0.5), _out(0.0, ok=False)]
    tags = [RequestTag("tenant-0", 1), RequestTag("tenant-1", 0), RequestTag("tenant-0", 0), RequestTag("tenant-1", 1)]
    g = group_metrics(outputs, tags, duration=2.0, slo_ttft_ms=200.0, slo_tpot_ms=None)
    assert list(g["by_tenant"]) == ["tenant-0", "tenant-1"] and list(g["by_priority"]) == ["1", "0"]
    t0, t1 = g["by_tenant"]["tenant-0"], g["by_tenant"]["tenant-1"]
    assert (t0["completed"], t0["failed"], t1["completed"], t1["failed"]) == (2, 0, 1, 1)
    assert t0["median_ttft_ms"] == pytest.approx(300.0)
    assert t0["goodput"] == pytest.approx(0.5) and t1["goodput"] == 0.0  # only the 100 ms TTFT is within SLO
    assert g["by_priority"]["1"]["goodput"] == pytest.approx(0.5) and g["by_priority"]["1"]["failed"] == 1
    assert group_metrics(outputs, [RequestTag()] * 4, 2.0, None, None) == {}


class _Recorder:
    """A /generate server on a real socket in its own thread that streams two tokens and records
    each request's tenant header, priority header and body ``priority``; a request whose header
    and body priorities differ is a 400."""

    def __init__(self):
        self.seen: list[tuple[str | None, str | None, int | None]] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handler(request):
            body = await request.json()
            head = request.headers.get(PRIORITY_HEADER)
            self.seen.append((request.headers.get("x-team"), head, body.get("priority")))
            if (head is None) != ("priority" not in body) or (head is not None and int(head) != body["priority"]):
                return web.json_response({"error": {"message": "priority mismatch"}}, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for k in (1, 2):
                meta = {"prompt_tokens": 4, "completion_tokens": k}
                await resp.write(b"data: " + json.dumps({"text": "a" * k, "meta_info": meta}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def start():
            app = web.Application()
            app.router.add_post("/generate", handler)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.timeout(60)
def test_each_request_carries_its_tenant_and_priority(tmp_path, capsys):
    stand = _Recorder()
    try:
        out_file = tmp_path / "r.jsonl"
        args = bs.parse_args(["--base-url", stand.url, "--num-prompts", "12", "--warmup-requests", "1",
                              "--disable-tqdm", "--output-file", str(out_file), "--tenants", "3",
                              "--tenant-weights", "2,1,1", "--tenant-header-name", "x-team",
                              "--priority-mix", "7:0.25,0:0.75", "--slo-ttft-ms", "60000"])
        res = bs.run_benchmark(args, rows=[DatasetRow("p", 4, 2, (7, 8, 9, 10))] * 12)
    finally:
        stand.stop()
    warmup, measured = stand.seen[0], stand.seen[1:]
    assert warmup == (None, None, None)  # warmup requests go untagged
    assert Counter(t for t, _, _ in measured) == {"tenant-0": 6, "tenant-1": 3, "tenant-2": 3}
    assert Counter(b for _, _, b in measured) == {7: 3, 0: 9}
    assert (res["completed"], res["failed"]) == (12, 0)
    assert {k: g["completed"] for k, g in res["by_tenant"].items()} == {"tenant-0": 6, "tenant-1": 3, "tenant-2": 3}
    assert {k: g["completed"] for k, g in res["by_priority"].items()} == {"7": 3, "0": 9}
    assert sum(g["goodput"] for g in res["by_priority"].values()) == pytest.approx(res["goodput"])
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("bench_serving tenant=") for line in printed) == 3
    assert sum(line.startswith("bench_serving priority=") for line in printed) == 2
    line = json.loads(out_file.read_text())
    assert line["by_tenant"]["tenant-1"]["completed"] == 3 and line["by_priority"]["7"]["completed"] == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--tenants", "-1"], "--tenants must be >= 0"),
    (["--tenant-weights", "1,1"], "--tenant-weights needs --tenants"),
    (["--tenants", "2", "--tenant-weights", "1"], "1 weight(s) for --tenants 2"),
    (["--tenants", "2", "--tenant-header-name", "x tenant"], "--tenant-header-name must be"),
    (["--priority-mix", "1:0.5"], "sum to 1"),
    (["--dataset", "multi-turn", "--tenants", "2"], "apply to --dataset random"),
])
def test_bad_fleet_arguments_exit_2(argv, message):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "usage:" in r.stderr
