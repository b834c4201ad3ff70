"""SGLang's flags with SGLang's meaning, checked where each takes effect, and no argparse
abbreviations anywhere: ``--mem 0.5`` must be an error, not ``--mem-fraction-static 0.5``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.entrypoints.flags import build_serve_parser, parse_serve_args
from pdserve.entrypoints.launch_flags import build_parser as build_launch_parser
from pdserve.entrypoints.launch_flags import parse_launch_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.frontend.request_error import decode_body
from pdserve.engine.frontend.request_schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pdserve.engine.frontend.sequences import chat_sequences, completion_sequences, generate_sequences
from pdserve.engine.frontend.value_checks import RequestLimits
from pdserve.engine.model_executor import model_runner
from pdserve.engine.text.chat_templates import CHATML, resolve_chat_template
from pdserve.engine.model_executor.model_loader import load_arch
from pdserve.engine.model_executor.sampling_defaults import DEFAULT_MODEL_SAMPLING, model_sampling_defaults
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
from pdserve.engine.sched.request import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler import Scheduler
from pdserve.router.cli import build_parser as build_router_parser

REPO = Path(__file__).resolve().parents[2]
TINY = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}


# --- abbreviations ---------------------------------------------------------------------------


@pytest.mark.parametrize("parser,argv", [
    (build_serve_parser, ["--mem", "0.5"]),
    (build_serve_parser, ["--context", "64"]),
    (build_router_parser, ["--prefill-pol", "random"]),
    (build_launch_parser, ["--pref", "2"]),
])
def test_an_abbreviated_flag_is_an_error(parser, argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_launch_passes_no_abbreviation_on_to_the_servers(capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(["--mem", "0.5"], build_serve_parser)
    assert "--mem" in capsys.readouterr().err


def test_every_argument_parser_in_the_repo_refuses_abbreviations():
    missing = []
    for path in REPO.rglob("*.py"):
        if ".venv" in path.parts or "site-packages" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False):
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing


# --- the flags reach the config --------------------------------------------------------------


def test_sglang_flags_reach_the_config(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    c = parse_serve_args(["--mem-fraction-static", "0.5", "--context-length", "64", "--tokenizer-path", str(tmp_path),
                          "--random-seed", "7", "--schedule-policy", "lpm", "--no-enable-metrics",
                          "--chat-template", str(template), "--sampling-defaults", "openai"])
    e = c.engine
    assert (e.mem_fraction_static, e.context_length, e.tokenizer_path, e.random_seed, e.schedule_policy,
            e.chat_template) == (0.5, 64, str(tmp_path), 7, "lpm", str(template))
    assert c.enable_metrics is False and c.sampling_defaults == "openai"
    d = parse_serve_args([])
    assert d.enable_metrics and d.sampling_defaults == "model" and d.engine.schedule_policy == "fcfs"


@pytest.mark.parametrize("argv,message", [
    (["--schedule-policy", "random"], "invalid choice: 'random'"),
    (["--sampling-defaults", "vllm"], "invalid choice: 'vllm'"),
])
def test_bad_choices_are_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kw,message", [
    ({"schedule_policy": "lpm", "disable_radix_cache": True}, "needs the radix cache"),
    ({"schedule_policy": "priority"}, "not implemented"),
    ({"chat_template": "no-such-template"}, "neither a file nor a known name"),
    ({"context_length": 1}, "context_length must be >= 2"),
    ({"mem_fraction_static": 0.0}, "mem_fraction_static must be in"),
])
def test_bad_values_are_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


# --- where each takes effect -----------------------------------------------------------------


def test_context_length_caps_the_model_and_longer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    arch = load_arch(str(tmp_path))
    assert arch.with_context_length(64).max_context_len == 64
    with pytest.raises(ValueError, match="longer than the model's 128"):
        arch.with_context_length(129)


def test_mem_fraction_static_covers_the_weights_and_the_kv_pages(tmp_path, monkeypatch):
    # CPU: a fraction of the host's memory, one budget split over the server's ranks, less this
    # rank's weights (rules in model_executor/pool_sizing.py, tested in tests/engine/test_pool_sizing.py)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    arch = load_arch(str(tmp_path))
    per_token = PagePool.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32)
    gib = 2**30
    monkeypatch.setattr(model_runner, "host_memory_bytes", lambda: 10 * gib)
    config = EngineConfig(mem_fraction_static=0.5, page_size=16, max_running_requests=10**6)
    pages = model_runner.pool_num_pages(config, arch, torch.float32, torch.device("cpu"), weights_bytes=2 * gib)
    # half of the host's 10 GiB, less the 2 GiB the weights took
    assert pages == (3 * gib // per_token) // 16 + 1
    with pytest.raises(ValueError, match="leaves no room for KV pages"):
        model_runner.pool_num_pages(EngineConfig(mem_fraction_static=0.2), arch, torch.float32,
                                    torch.device("cpu"), weights_bytes=2 * gib)


def test_lpm_admits_the_longest_cached_prefix_first():
    ps = 4

    def order(policy: str) -> list[str]:
        pool = PagePool(64, ps, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        sched = Scheduler(EngineConfig(page_size=ps, schedule_policy=policy), pool, make_prefix_cache(pool, False))
        shared = list(range(10, 22))  # three pages, cached below
        sched.cache.insert(shared, pool.alloc(3), 0)
        for rid, prompt in (("cold", list(range(50, 64))), ("warm", shared + [1, 2])):
            sched.add(Req(rid, prompt, SamplingParams(max_new_tokens=2, temperature=0.0)))
        return [r.rid for r in sched.schedule().reqs]

    assert order("fcfs") == ["cold", "warm"]
    assert order("lpm") == ["warm", "cold"]


def test_chat_template_by_name_and_by_file(tmp_path):
    assert resolve_chat_template("chatml") == CHATML
    f = tmp_path / "mine.jinja"
    f.write_text("{{ messages[0]['content'] }}!")
    assert resolve_chat_template(str(f)).endswith("!")
    f.write_text("{% for %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template(str(f))


# --- sampling defaults -----------------------------------------------------------------------

LIMITS = dict(model_names=frozenset({"m"}), max_n=4, dp_size=1, vocab_size=1000)
MSG = b'{"messages": [{"role": "user", "content": "hi"}]'


def test_sampling_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert model_sampling_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "do_sample": True, "eos_token_id": 2}))
    assert model_sampling_defaults(str(tmp_path)) == {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    assert model_sampling_defaults(None) == DEFAULT_MODEL_SAMPLING  # the bundled GGUF: its model card's


def test_model_defaults_fill_what_an_openai_request_leaves_out():
    model = RequestLimits(**LIMITS, sampling_defaults={"temperature": 0.3, "top_p": 0.8, "top_k": 20})
    openai = RequestLimits(**LIMITS)
    (seq,) = chat_sequences(decode_body(MSG + b"}", ChatCompletionRequest), model)
    sp = seq.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.3, 0.8, 20)
    (seq,) = chat_sequences(decode_body(MSG + b', "temperature": 0.9}', ChatCompletionRequest), model)
    assert (seq.sampling_params.temperature, seq.sampling_params.top_p) == (0.9, 0.8)  # the request's wins
    (seq,) = completion_sequences(decode_body(b'{"prompt": "hi"}', CompletionRequest), model)
    assert seq.sampling_params.temperature == 0.3
    (seq,) = chat_sequences(decode_body(MSG + b"}", ChatCompletionRequest), openai)
    assert (seq.sampling_params.temperature, seq.sampling_params.top_p) == (1.0, 1.0)  # OpenAI's
    # SGLang's /generate keeps its own defaults either way
    (seq,), _ = generate_sequences(decode_body(b'{"text": "hi"}', GenerateRequest), model)
    assert seq.sampling_params.temperature == 1.0


def test_python_m_serve_rejects_an_abbreviation():
    r = subprocess.run([sys.executable, "-m", "pdserve.engine", "--mem", "0.5"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 2 and "unrecognized arguments: --mem" in r.stderr


def test_sampling_defaults_come_from_gguf_metadata(tmp_path):
    """llama.cpp's ``general.sampling.*`` keys, read from the file's header."""
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.5)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.penalty_repeat", 1.25)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert model_sampling_defaults(str(path)) == {"temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}
