"""The serve CLI, ServerConfig, the request protocol and the /metrics text, without a model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import pytest

from pdserve.entrypoints.cli import main
from pdserve.entrypoints.flags import build_serve_parser, parse_serve_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import SchedulerError, SchedulerOutput, SchedulerReady, SchedulerStats, TokenOutput
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.frontend.request_error import RequestError, decode_body
from pdserve.engine.frontend.request_schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pdserve.engine.frontend.sequences import chat_sequences, completion_sequences, generate_sequences
from pdserve.engine.frontend.value_checks import RequestLimits
from pdserve.engine.server_config import ServerConfig

LIMITS = RequestLimits(model_names=frozenset({"m", "default"}), max_n=4, dp_size=2, vocab_size=1000)


def test_cli_defaults_come_from_the_dataclasses():
    config = parse_serve_args([])
    assert config == ServerConfig()
    flags = {a.dest for a in build_serve_parser()._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags
    assert set(ServerConfig.server_field_names()) <= flags


def test_cli_flags_reach_the_config():
    c = parse_serve_args(
        ["--dp-size", "2", "--page-size", "32", "--disable-radix-cache", "--api-key", "k", "--port", "1234",
         "--disaggregation-mode", "decode", "--max-total-tokens", "4096"]
    )
    assert (c.dp_size, c.engine.page_size, c.engine.disable_radix_cache, c.api_key, c.port) == (2, 32, True, "k", 1234)
    assert c.disaggregation_mode == "decode" and c.engine.max_total_tokens == 4096


def test_cli_rejects_bad_values_with_the_field_name(capsys):
    assert main(["serve", "--dp-size", "0"]) == 2
    assert "dp_size" in capsys.readouterr().err
    assert main(["serve", "--max-n", "0"]) == 2
    assert "max_n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--dtype", "float8"])
    assert main(["nonsense"]) == 2


# runs a command line in a fresh interpreter, then reports which heavy modules it had imported
_RUN_CLI = """
import sys
from {module} import main
try:
    main(sys.argv[1:])
finally:
    print("imported:", [m for m in {heavy} if m in sys.modules])
"""
_MODEL_MODULES = ["pdserve.entrypoints.serve", "pdserve.engine.model_executor.model_runner",
                  "pdserve.engine.sched.scheduler_process"]


def test_unknown_attention_backend_is_a_cli_error_before_anything_starts():
    code = _RUN_CLI.format(module="pdserve.entrypoints.cli", heavy=_MODEL_MODULES)
    out = subprocess.run([sys.executable, "-c", code, "serve", "--attention-backend", "troch"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    assert "--attention-backend: invalid choice: 'troch'" in out.stderr
    assert "'torch'" in out.stderr and "'flashinfer'" in out.stderr  # the choices are named
    assert "imported: []" in out.stdout  # no server, rank or model was started
    with pytest.raises(SystemExit):
        parse_serve_args(["--attention-backend", "troch"])
    assert parse_serve_args(["--attention-backend", "flashinfer"]).engine.attention_backend == "flashinfer"


def test_python_m_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "pdserve.engine", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--dp-size" in out.stdout and "--api-key" in out.stdout


def test_scheduler_output_messages_round_trip():
    msgs = [
        SchedulerReady(dp_rank=1, vocab_size=10, max_context_len=20, eos_token_ids=[2], page_size=16,
                       max_total_num_tokens=4096, num_threads=2),
        SchedulerError(dp_rank=0, message="boom"),
        SchedulerStats(dp_rank=0, num_running=1, num_waiting=2, num_free_pages=3, num_total_pages=4, page_size=16),
        TokenOutput(rid="r", new_token_ids=[1], prompt_tokens=2, completion_tokens=1),
    ]
    raw = msgspec.msgpack.encode(msgs)
    assert msgspec.msgpack.decode(raw, type=list[SchedulerOutput]) == msgs


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_names_labels_and_per_rank_gauges():
    m = ServerMetrics(dp_size=2, model_name="m")
    m.on_dispatch(1)
    m.on_http("/generate", 200)
    m.on_finish("stop", prompt_tokens=5, completion_tokens=3, cached=2, e2e=0.2)
    m.ttft.observe(0.02)
    m.tpot.observe(0.003)
    stats = [SchedulerStats(dp_rank=0, num_running=1, num_waiting=2, num_free_pages=3, num_total_pages=4,
                            page_size=16), None]  # rank 1 has not reported yet
    s = _samples(m.render(stats, inflight=[1, 0]))
    assert s['pdserve_requests_total{model_name="m",dp_rank="0"}'] == 0
    assert s['pdserve_requests_total{model_name="m",dp_rank="1"}'] == 1
    assert s['pdserve_requests_finished_total{model_name="m",reason="stop"}'] == 1
    assert s['pdserve_http_requests_total{path="/generate",status="200"}'] == 1
    assert s['pdserve_prompt_tokens_total{model_name="m"}'] == 5
    assert s['pdserve_generation_tokens_total{model_name="m"}'] == 3
    assert s['pdserve_cached_tokens_total{model_name="m"}'] == 2
    assert s['pdserve_time_to_first_token_seconds_bucket{le="0.01"}'] == 0
    assert s['pdserve_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert s["pdserve_time_per_output_token_seconds_count"] == 1
    assert s["pdserve_e2e_request_latency_seconds_sum"] == 0.2
    assert s['pdserve_num_running_reqs{model_name="m",dp_rank="0"}'] == 1
    assert s['pdserve_num_waiting_reqs{model_name="m",dp_rank="0"}'] == 2
    assert s['pdserve_kv_usage{model_name="m",dp_rank="0"}'] == 0.25
    assert s['pdserve_inflight_requests{model_name="m",dp_rank="0"}'] == 1
    assert not any(k.startswith("pdserve_kv_free_pages") and 'dp_rank="1"' in k for k in s)
    assert not any("_created" in k for k in s)
    other = _samples(ServerMetrics(dp_size=1, model_name="m").render([None], [0]))
    assert other['pdserve_requests_total{model_name="m",dp_rank="0"}'] == 0  # its own registry


def _err(fn, body: bytes, type_) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(decode_body(body, type_), LIMITS)
    return e.value


def test_n_fans_out_with_distinct_rids_and_seeds():
    req = decode_body(b'{"prompt": ["a", "b"], "n": 3, "seed": 5, "rid": ["x", "y"]}', CompletionRequest)
    seqs = completion_sequences(req, LIMITS)
    assert [s.rid for s in seqs] == ["x-0", "x-1", "x-2", "y-0", "y-1", "y-2"]
    assert [s.index for s in seqs] == list(range(6))
    assert [s.sampling_params.seed for s in seqs[:3]] == [5, 6, 7]
    assert {s.prompt_index for s in seqs[3:]} == {1}


def test_generate_batch_and_sampling_params():
    req = decode_body(
        b'{"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 3, "stop": "x", "sampling_seed": 4},'
        b' "data_parallel_rank": 1}',
        GenerateRequest,
    )
    seqs, batch = generate_sequences(req, LIMITS)
    assert batch and [s.prompt for s in seqs] == [[1, 2], [3]]
    assert seqs[0].sampling_params.stop == ["x"] and seqs[0].sampling_params.seed == 4
    assert seqs[0].routed_dp_rank == 1
    single, batch = generate_sequences(decode_body(b'{"text": "hi"}', GenerateRequest), LIMITS)
    assert not batch and single[0].sampling_params.max_new_tokens == 128  # SGLang's default


def test_chat_defaults_and_max_completion_tokens():
    req = decode_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', ChatCompletionRequest)
    (seq,) = chat_sequences(req, LIMITS)
    assert seq.prompt.messages == [{"role": "user", "content": "hi"}]
    assert not seq.max_tokens_given  # clamped to the context by the tokenizer manager
    req = decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}', ChatCompletionRequest)
    (seq,) = chat_sequences(req, LIMITS)
    assert seq.sampling_params.max_new_tokens == 7 and seq.max_tokens_param == "max_completion_tokens"


def test_bootstrap_fields():
    body = b'{"text": "hi", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}'
    (seq,), _ = generate_sequences(decode_body(body, GenerateRequest), LIMITS)
    assert (seq.bootstrap.host, seq.bootstrap.port, seq.bootstrap.room) == ("10.0.0.1", 8998, 12345)
    e = _err(generate_sequences, b'{"text": "hi", "bootstrap_room": 1}', GenerateRequest)
    assert e.param == "bootstrap_host"
    prefill = dataclasses.replace(LIMITS, disaggregation_mode="prefill")
    with pytest.raises(RequestError) as e:
        generate_sequences(decode_body(b'{"text": "hi"}', GenerateRequest), prefill)
    assert "bootstrap" in e.value.message


def test_unsupported_features_are_named():
    # tools and regex are supported since structured output (tests/structured); what stays
    # unsupported, and malformed tools, are still named
    e = _err(chat_sequences, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
             ChatCompletionRequest)
    assert e.param == "tools[0]"
    e = _err(generate_sequences, b'{"text": "hi", "sampling_params": {"structural_tag": "{}"}}', GenerateRequest)
    assert e.param == "structural_tag" and e.code == "unsupported"
    e = _err(completion_sequences, b'{"prompt": "hi", "logit_bias": {"5": 10}}', CompletionRequest)
    assert e.param == "logit_bias"
    e = _err(chat_sequences, b'{"messages": [{"role": "robot", "content": "hi"}]}', ChatCompletionRequest)
    assert e.param == "messages[0].role"


def test_start_up_failure_exits_non_zero_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.engine", "--model-path", "/nonexistent", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1
    assert "failed to start" in out.stderr and "/nonexistent" in out.stderr
