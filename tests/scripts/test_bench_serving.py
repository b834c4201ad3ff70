"""scripts/bench_serving.py: workloads, metrics on known timings, client timing against
a real socket, argument errors, and end-to-end runs against a real pdserve server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pdserve.entrypoints.procs import free_port, spawn, stop_group, wait_healthy

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_serving.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # also puts scripts/ on sys.path for benchlib
    return mod


bs = _load_script()
from benchlib import datasets  # noqa: E402
from benchlib.client import BACKENDS, send_request  # noqa: E402
from benchlib.datasets import DatasetRow  # noqa: E402
from benchlib.metrics import RequestOutput, calculate_metrics, format_table  # noqa: E402

METRIC_KEYS = [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "p90", "p99", "max")
] + [
    "request_throughput", "input_throughput", "output_throughput", "total_input_tokens", "total_output_tokens",
    "completed", "failed", "duration", "goodput", "slo_attainment", "concurrency",
]


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(None)


# --- workloads ---------------------------------------------------------------------------------


def _write_sharegpt(path: Path) -> None:
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is the capital of France? Answer briefly."},
                                      {"from": "gpt", "value": "The capital of France is Paris, a large city."}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be nice"},
                                      {"from": "human", "value": "Tell me a short story about a small red fox."},
                                      {"from": "gpt", "value": "Once upon a time a small red fox lived in a wood."},
                                      {"from": "human", "value": "second turn, ignored"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only a question, no answer"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
        {"id": "e"},
        "not a dict",
        {"id": "f", "conversations": [{"from": "human", "value": "Count from one to ten in words please."},
                                      {"from": "gpt", "value": "one two three four five six seven eight nine ten"}]},
    ]
    path.write_text(json.dumps(convs))


def test_sharegpt_loader(tmp_path, tokenizer):
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    pairs = datasets.load_sharegpt(str(path))
    # c (no gpt turn), e (no conversations) and the string are skipped; b's system turn is not the prompt
    assert [h for h, _ in pairs] == [
        "What is the capital of France? Answer briefly.",
        "Tell me a short story about a small red fox.",
        "Hi",
        "Count from one to ten in words please.",
    ]
    assert pairs[1][1] == "Once upon a time a small red fox lived in a wood."

    rows = datasets.sample_sharegpt(tokenizer, str(path), 10, seed=0)
    # "Hi" is a single token: too short to time, dropped as SGLang does
    assert sorted(r.prompt for r in rows) == sorted(h for h, _ in pairs if h != "Hi")
    by_prompt = dict(pairs)
    for r in rows:
        assert r.prompt_ids is None and r.system is None
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert r.output_len == len(tokenizer.encode(by_prompt[r.prompt], add_special_tokens=False))

    assert datasets.sample_sharegpt(tokenizer, str(path), 10, seed=0) == rows  # deterministic
    orders = {tuple(r.prompt for r in datasets.sample_sharegpt(tokenizer, str(path), 10, seed=s)) for s in range(6)}
    assert len(orders) > 1  # the seed shuffles
    two = datasets.sample_sharegpt(tokenizer, str(path), 2, seed=0, fixed_output_len=7)
    assert len(two) == 2 and all(r.output_len == 7 for r in two)
    ctx = sorted(r.prompt_len + r.output_len for r in rows)[1]
    short = datasets.sample_sharegpt(tokenizer, str(path), 10, seed=0, context_len=ctx)
    assert 1 <= len(short) < len(rows) and all(r.prompt_len + r.output_len <= ctx for r in short)


def test_sharegpt_loader_rejects_non_list(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        datasets.load_sharegpt(str(p))
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        datasets.load_sharegpt(str(p))


def test_random_dataset(tokenizer):
    rows = datasets.sample_random(tokenizer, 50, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    assert len(rows) == 50
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for r in rows:
        assert 20 <= r.prompt_len <= 40 and 10 <= r.output_len <= 20
        assert len(r.prompt_ids) == r.prompt_len
        assert not special & set(r.prompt_ids)
        assert r.prompt == tokenizer.decode(list(r.prompt_ids))
    assert len({r.prompt_len for r in rows}) > 5  # lengths do vary
    assert datasets.sample_random(tokenizer, 50, 40, 20, 0.5, seed=3) == rows
    assert datasets.sample_random(tokenizer, 50, 40, 20, 0.5, seed=4) != rows
    exact = datasets.sample_random(tokenizer, 5, 16, 4, 1.0, seed=0)
    assert [(r.prompt_len, r.output_len) for r in exact] == [(16, 4)] * 5


def test_shared_prefix_dataset(tokenizer):
    rows = datasets.sample_shared_prefix(tokenizer, num_groups=3, prompts_per_group=4, system_prompt_len=30,
                                         question_len=6, output_len=5, seed=1)
    assert len(rows) == 12
    prefixes: dict[tuple, int] = {}
    for r in rows:
        assert r.prompt_len == 36 == len(r.prompt_ids) and r.output_len == 5
        prefixes[r.prompt_ids[:30]] = prefixes.get(r.prompt_ids[:30], 0) + 1
        assert r.system == tokenizer.decode(list(r.prompt_ids[:30]))
        assert r.question == tokenizer.decode(list(r.prompt_ids[30:]))
    assert sorted(prefixes.values()) == [4, 4, 4]
    assert len({r.prompt_ids for r in rows}) == 12  # questions differ
    # shuffled: a group's prompts are not all back to back
    groups = [list(prefixes).index(r.prompt_ids[:30]) for r in rows]
    assert groups != sorted(groups)
    assert datasets.sample_shared_prefix(tokenizer, 3, 4, 30, 6, 5, seed=1) == rows
    assert datasets.sample_shared_prefix(tokenizer, 3, 4, 30, 6, 5, seed=2) != rows


def test_request_bodies_ask_exact_length():
    row = DatasetRow("hello world", 2, 9, prompt_ids=(5, 6))
    g = BACKENDS["generate"]().body(row, 9, None)
    assert g["input_ids"] == [5, 6] and g["stream"] is True
    assert g["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 9, "ignore_eos": True}
    c = BACKENDS["completions"]().body(row, 9, "m")
    assert c["prompt"] == [5, 6] and c["max_tokens"] == 9 and c["ignore_eos"] is True and c["model"] == "m"
    assert c["stream_options"] == {"include_usage": True}
    ch = BACKENDS["chat"]().body(row, 9, None)
    assert ch["messages"] == [{"role": "user", "content": "hello world"}] and "model" not in ch
    sp = BACKENDS["chat"]().body(DatasetRow("S Q", 2, 3, (1, 2), system="S", question="Q"), 3, None)
    assert sp["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert BACKENDS["generate"]().body(DatasetRow("txt", 1, 2), 2, None)["text"] == "txt"


def test_arrival_offsets():
    assert bs.arrival_offsets(4, float("inf"), 0) == [0.0] * 4
    a = bs.arrival_offsets(2000, 50.0, 7)
    assert a == bs.arrival_offsets(2000, 50.0, 7) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert 2000 / a[-1] == pytest.approx(50.0, rel=0.1)  # mean rate


# --- metrics on known timings ------------------------------------------------------------------


def _synthetic() -> list[RequestOutput]:
    return [
        RequestOutput(True, "", 5, 10, 10, ttft=0.1, latency=1.0, itl=[0.1] * 9),  # tpot 100 ms
        RequestOutput(True, "", 7, 5, 5, ttft=0.3, latency=2.3, itl=[0.5] * 4),  # tpot 500 ms
        RequestOutput(True, "", 3, 1, 1, ttft=0.2, latency=0.2, itl=[]),  # one token: no tpot
        RequestOutput(False, "HTTP 503: overloaded", 4, 8, 0, latency=0.05),
    ]


def test_metrics_known_answers():
    m = calculate_metrics(_synthetic(), duration=4.0, slo_ttft_ms=250.0, slo_tpot_ms=200.0)
    approx = pytest.approx
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (15, 16)
    assert m["request_throughput"] == approx(0.75)
    assert m["input_throughput"] == approx(3.75) and m["output_throughput"] == approx(4.0)
    assert m["mean_ttft_ms"] == approx(200) and m["median_ttft_ms"] == approx(200)
    assert m["p90_ttft_ms"] == approx(280) and m["p99_ttft_ms"] == approx(298) and m["max_ttft_ms"] == approx(300)
    assert m["mean_tpot_ms"] == approx(300) and m["median_tpot_ms"] == approx(300)
    assert m["p90_tpot_ms"] == approx(460) and m["max_tpot_ms"] == approx(500)
    assert m["mean_itl_ms"] == approx(2900 / 13) and m["median_itl_ms"] == approx(100)
    assert m["max_itl_ms"] == approx(500)
    assert m["mean_e2e_latency_ms"] == approx(3500 / 3) and m["median_e2e_latency_ms"] == approx(1000)
    assert m["max_e2e_latency_ms"] == approx(2300)
    assert m["concurrency"] == approx(3.5 / 4)
    # A meets both; B's TTFT is over; C has no TPOT (one token) and meets TTFT; D failed
    assert m["goodput"] == approx(0.5) and m["slo_attainment"] == approx(0.5)
    only_tpot = calculate_metrics(_synthetic(), 4.0, slo_tpot_ms=200.0)
    assert only_tpot["goodput"] == approx(0.5)  # B's TPOT is over
    none = calculate_metrics(_synthetic(), 4.0)
    assert none["goodput"] == approx(0.75) and none["slo_attainment"] == approx(0.75)
    assert set(METRIC_KEYS) <= set(m)
    table = format_table(m, [("Backend:", "x")])
    assert "Median TTFT (ms):" in table and "200.00" in table and "Goodput (req/s):" in table


def test_metrics_all_failed_are_null_not_zero():
    m = calculate_metrics([RequestOutput(False, "boom")], 1.0, 100.0, 100.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["median_ttft_ms"] is None and m["p99_tpot_ms"] is None
    assert m["goodput"] == 0.0 and m["slo_attainment"] == 0.0


# --- the client's timing, against a real socket --------------------------------------------------


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _stream(request, events, delays, sent=None):
    """Write ``events`` with ``delays`` before each; ``sent`` gets the ``perf_counter`` of each write."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for ev, d in zip(events, delays):
        await asyncio.sleep(d)
        if sent is not None:
            sent.append(time.perf_counter())
        await resp.write(ev)
    return resp


@pytest.mark.timeout(30)
async def test_client_times_tokens_and_splits_multi_token_events():
    def gen(n, text):
        return _sse({"text": text, "output_ids": list(range(n)),
                     "meta_info": {"prompt_tokens": 3, "completion_tokens": n}})

    sent: list[float] = []  # when the server wrote each event (the client's clock: one process)

    async def handler(request):
        # token 1, then tokens 2-3 in one event, then token 4, then the end of the stream
        return await _stream(request, [gen(1, "a"), gen(3, "abc"), gen(4, "abcd"), b"data: [DONE]\n\n"],
                             [0.2, 0.2, 0.1, 0.0], sent)

    runner, url = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as s:
            row = DatasetRow("p", 2, 4, (1, 2))
            start = time.perf_counter()
            out = await send_request(s, url, BACKENDS["generate"](), row, None, start)
    finally:
        await runner.cleanup()
    assert out.success, out.error
    assert (out.prompt_len, out.output_len, out.generated_text) == (3, 4, "abcd")
    assert len(sent) == 4 and len(out.itl) == 3
    # each token is timed at its event's arrival, which follows the server's write of that event
    # (however loaded the machine, only later): token 1 by the first event, 2-3 by the second
    arrivals = [out.ttft + sum(out.itl[:k]) for k in range(4)]
    assert start + arrivals[0] >= sent[0]
    assert start + arrivals[2] >= sent[1] and start + arrivals[3] >= sent[2]
    assert out.itl[0] == out.itl[1]  # the gap before a two-token event is shared by its tokens
    assert arrivals == sorted(arrivals)
    assert out.latency >= out.ttft + sum(out.itl) - 1e-6
    assert out.tpot == pytest.approx((out.latency - out.ttft) / 3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "events, error",
    [
        ([b"data: " + json.dumps({"error": {"message": "KV transfer failed"}}).encode() + b"\n\n"],
         "KV transfer failed"),
        ([_sse({"choices": [{"delta": {"content": "x"}}]})], "without data: [DONE]"),
        ([_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), b"data: [DONE]\n\n"],
         "no output token"),
        ([b"data: {nope\n\n"], "bad JSON"),
    ],
)
async def test_client_stream_failures_are_errors(events, error):
    async def handler(request):
        return await _stream(request, events, [0.0] * len(events))

    runner, url = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as s:
            out = await send_request(s, url, BACKENDS["chat"](), DatasetRow("p", 1, 2), None, time.perf_counter())
    finally:
        await runner.cleanup()
    assert not out.success and error in out.error


@pytest.mark.timeout(30)
async def test_client_http_error_and_chat_role_chunk_is_not_a_token():
    async def handler(request):
        body = await request.json()
        if body["max_tokens"] == 1:
            return web.json_response({"error": {"message": "bad max_tokens"}}, status=400)
        chunks = [_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
                  _sse({"choices": [{"delta": {"content": "he"}}]}),
                  _sse({"choices": [{"delta": {"content": "llo"}}]}),
                  _sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}),
                  b"data: [DONE]\n\n"]
        return await _stream(request, chunks, [0.0, 0.15, 0.05, 0.0, 0.0])

    runner, url = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as s:
            ok = await send_request(s, url, BACKENDS["chat"](), DatasetRow("p", 1, 2), None, time.perf_counter())
            bad = await send_request(s, url, BACKENDS["chat"](), DatasetRow("p", 1, 1), None, time.perf_counter())
    finally:
        await runner.cleanup()
    assert ok.success and ok.output_len == 2 and ok.prompt_len == 9 and ok.generated_text == "hello"
    assert ok.ttft >= 0.14 and len(ok.itl) == 1  # the role chunk at t=0 is not the first token
    assert not bad.success and bad.error.startswith("HTTP 400") and "bad max_tokens" in bad.error


class _StandInThread:
    """A tiny /generate server on a real socket in its own thread: every third request
    fails with 503; others stream two tokens. Records the most requests in flight."""

    def __init__(self):
        self.inflight = 0
        self.max_inflight = 0
        self.count = 0
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _handler(self, request):
        self.count += 1
        n = self.count
        if n % 3 == 0:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            ev = [_sse({"text": "a" * k, "meta_info": {"prompt_tokens": 4, "completion_tokens": k}}) for k in (1, 2)]
            return await _stream(request, ev + [b"data: [DONE]\n\n"], [0.05, 0.05, 0.0])
        finally:
            self.inflight -= 1

    def _run(self):
        asyncio.set_event_loop(self.loop)

        async def start():
            app = web.Application()
            app.router.add_post("/generate", self._handler)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        self.loop.run_until_complete(start())
        self.ready.set()
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.timeout(60)
def test_run_benchmark_in_process_counts_failures_and_caps_concurrency(tmp_path, capsys):
    stand = _StandInThread()
    try:
        out_file = tmp_path / "r.jsonl"
        args = bs.parse_args(["--base-url", stand.url, "--backend", "generate", "--num-prompts", "12",
                              "--max-concurrency", "3", "--warmup-requests", "0", "--disable-tqdm",
                              "--output-file", str(out_file), "--api-key", "secret-key"])
        rows = [DatasetRow("p", 4, 2, (7, 8, 9, 10))] * 12
        res = bs.run_benchmark(args, rows=rows)
    finally:
        stand.stop()
    printed = capsys.readouterr().out
    assert (res["completed"], res["failed"]) == (8, 4)
    assert res["error_counts"] == {'HTTP 503: {"error": {"message": "overloaded"}}': 4}
    assert "4 request(s) failed:" in printed and "4 x HTTP 503" in printed
    assert res["total_output_tokens"] == 16 and res["slo_attainment"] == pytest.approx(8 / 12)
    assert 1 <= stand.max_inflight <= 3
    line = json.loads(out_file.read_text())
    assert line["failed"] == 4 and line["request_rate"] == "inf" and line["api_key"] == "***"
    assert "ttfts" not in line  # per-request arrays only with --output-details
    assert "secret-key" not in out_file.read_text()


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--request-rate", "-1"], "--request-rate must be > 0"),
        (["--request-rate", "abc"], "not a number"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--dataset", "sharegpt", "--dataset-path", "/nonexistent/sg.json"], "no such file"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1]"),
        (["--base-url", "localhost:30000"], "--base-url must start with http"),
        (["--dataset", "multi-turn", "--backend", "chat"], "needs --backend generate"),
        (["--dataset", "multi-turn", "--mt-turns", "0"], "--mt-turns must be >= 1"),
    ],
)
def test_bad_arguments_exit_2(argv, message):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "usage:" in r.stderr


# --- end to end against a real pdserve server ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = spawn([sys.executable, "-m", "pdserve.engine", "--port", str(port), "--max-total-tokens", "2048",
                  "--log-level", "warning"], log, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 240, name="server", log=lambda: log.read_text()[-3000:])
        yield url
    finally:
        stop_group(proc, grace=15.0)


WORKLOADS = {
    # generate: random ids, a concurrency cap, plots
    "generate": ["--dataset", "random", "--random-input-len", "16", "--random-output-len", "4",
                 "--random-range-ratio", "1", "--max-concurrency", "6", "--plot", "{tmp}/plots"],
    "completions": ["--dataset", "sharegpt", "--sharegpt-output-len", "4", "--dataset-path", "{tmp}/sg.json"],
    "chat": ["--dataset", "shared-prefix", "--sp-num-groups", "2", "--sp-prompts-per-group", "5",
             "--sp-system-prompt-len", "24", "--sp-question-len", "4", "--sp-output-len", "4"],
}


MULTI_TURN = ["--dataset", "multi-turn", "--mt-conversations", "3", "--mt-turns", "3", "--mt-message-len", "16",
              "--mt-answer-len", "8", "--mt-think-time", "0.1"]


@pytest.fixture(scope="module")
def e2e_runs(server, tmp_path_factory):
    """The script run as a subprocess once per backend, the three at the same time (the
    server batches them together, which keeps this short on a small machine)."""
    procs = {}
    for backend, workload in WORKLOADS.items():
        tmp = tmp_path_factory.mktemp(backend)
        _write_sharegpt(tmp / "sg.json")
        argv = [sys.executable, str(SCRIPT), "--base-url", server, "--backend", backend,
                *[a.format(tmp=tmp) for a in workload],
                "--num-prompts", "10", "--request-rate", "40", "--warmup-requests", "1", "--seed", "5",
                "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--output-file", str(tmp / "runs.jsonl"),
                "--output-details", "--disable-tqdm"]
        procs[backend] = (tmp, subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True))
    runs = {}
    try:
        for backend, (tmp, proc) in procs.items():
            out, err = proc.communicate(timeout=170)
            runs[backend] = (tmp, proc.returncode, out, err)
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return runs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", list(WORKLOADS))
def test_end_to_end_against_real_server(e2e_runs, backend):
    tmp, rc, stdout, stderr = e2e_runs[backend]
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert "Serving Benchmark Result" in stdout and "Median TTFT (ms):" in stdout
    assert stdout.strip().splitlines()[-1].startswith(f"bench_serving {backend}")

    lines = (tmp / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    missing = [k for k in METRIC_KEYS if k not in res]
    assert not missing
    n = 3 if backend == "completions" else 10  # the small ShareGPT file has 3 usable conversations
    assert res["completed"] == n and res["failed"] == 0 and res["error_counts"] == {}
    assert res["output_lens"] == [4] * n and res["total_output_tokens"] == 4 * n
    assert res["output_len_mismatches"] == 0
    for k in METRIC_KEYS:
        assert res[k] is not None and res[k] >= 0, k
    assert 0 < res["median_ttft_ms"] <= res["max_ttft_ms"] <= res["max_e2e_latency_ms"]
    assert res["mean_tpot_ms"] > 0 and len(res["itls"]) == n and all(len(x) >= 1 for x in res["itls"])
    assert res["goodput"] == pytest.approx(res["request_throughput"]) and res["slo_attainment"] == 1.0
    assert res["backend"] == backend and res["request_rate"] == 40.0
    if backend != "chat":  # chat adds the template's tokens to the prompt
        assert res["total_input_tokens"] == sum(res["input_lens"])
    if backend == "generate":
        assert res["input_lens"] == [16] * n  # ids sent as is: the server counts exactly those
        assert res["max_concurrency"] == 6
        for name in ("ttft_cdf.png", "tpot_cdf.png", "timeline.png"):
            data = (tmp / "plots" / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.timeout(240)
def test_multi_turn_against_real_server(e2e_runs, server, tokenizer, tmp_path, capsys):
    """Each turn's prompt is the history plus a message; the server's pool holds every conversation,
    so every earlier turn's full pages are cached: the hit rate is the ideal's. In process, after
    the other workloads (their subprocesses' start-up is what costs)."""
    args = bs.parse_args(["--base-url", server, *MULTI_TURN, "--output-file", str(tmp_path / "runs.jsonl")])
    assert bs.run_multi_turn(args, tokenizer=tokenizer)["failed"] == 0
    stdout = capsys.readouterr().out
    assert stdout.strip().splitlines()[-1].startswith("bench_serving multi-turn (generated): 3 conversations x 3")
    res = json.loads((tmp_path / "runs.jsonl").read_text())
    assert res["requests"] == 9 and res["failed"] == 0
    # turn 2: 16 + 8 + 16 tokens, 24 of them history: 1 full page of it; turn 3: 64 tokens, 48 history: 2
    assert [res["by_turn"][t]["ideal"] for t in ("1", "2", "3")] == [0, 3 * 16, 3 * 32]
    assert res["hit_rate"] == 1.0 and res["cached_tokens"] == res["ideal_cached_tokens"] == 3 * 48
    assert res["computed_tokens"] == res["prompt_tokens"] - res["cached_tokens"] == 3 * (16 + 40 + 64) - 3 * 48
    assert all(res["by_turn"][t]["p50_ttft_ms"] > 0 for t in ("1", "2", "3"))
    # nothing else ran meanwhile: the server counted the same tokens
    assert res["servers"]["cached_tokens"] == res["cached_tokens"]
    assert res["servers"]["prompt_tokens"] == res["prompt_tokens"]
