"""A server on a tiny random checkpoint started with SGLang's flags, each checked where it shows:
``--context-length``, ``--tokenizer-path``, ``--chat-template``, ``--sampling-defaults model`` (the
checkpoint's generation_config.json asks for top_k 1, i.e. greedy), ``--no-enable-metrics``,
``--schedule-policy lpm``, ``--random-seed``; and ``/tokenize``, ``/detokenize``, ``/health_generate``
and JSON 404/405 answers."""

from __future__ import annotations

import json

import pytest
import requests
from support.model_util import make_tiny_checkpoint
from server_helpers import ServerProcess

pytestmark = pytest.mark.timeout(300)
CONTEXT = 64
MSG = [{"role": "user", "content": "w5 w6 w7"}]


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer whose words differ from the checkpoint's own (w<i> instead of t<i>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2").save_pretrained(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint("llama", str(model))
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1, "eos_token_id": 2}))
    tok = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(str(tok))
    srv = ServerProcess("--model-path", str(model), "--tokenizer-path", str(tok), "--chat-template", "chatml",
                        "--context-length", str(CONTEXT), "--no-enable-metrics", "--schedule-policy", "lpm",
                        "--random-seed", "3")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_context_length_caps_the_served_context(server):
    assert server.get("/get_model_info").json()["max_context_len"] == CONTEXT
    r = server.post("/generate", {"input_ids": [5] * (CONTEXT + 6), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_tokenize_and_detokenize_use_the_tokenizer_path(server):
    r = server.post("/tokenize", {"prompt": "w5 w6 w7"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": [5, 6, 7], "count": 3, "max_model_len": CONTEXT}
    r = server.post("/v1/tokenize", {"prompt": ["w1", "w9 w9"], "add_special_tokens": False})
    assert r.json()["tokens"] == [[1], [9, 9]] and r.json()["count"] == [1, 2]
    assert server.post("/detokenize", {"tokens": [5, 6, 7]}).json() == {"text": "w5 w6 w7"}
    assert server.post("/v1/detokenize", {"tokens": [[5], [6, 7]]}).json() == {"text": ["w5", "w6 w7"]}
    r = server.post("/detokenize", {"tokens": [5, 100000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = server.post("/tokenize", {"prompt": "w5", "model": "not-this-one"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_chat_template_and_model_sampling_defaults(server):
    """The checkpoint has no chat template (chatml is given) and asks for top_k 1 in its
    generation_config.json: a chat request without sampling fields is greedy."""
    body = {"messages": MSG, "max_tokens": 8, "ignore_eos": True}
    default = [server.post("/v1/chat/completions", body) for _ in range(2)]
    greedy = server.post("/v1/chat/completions", {**body, "temperature": 0})
    assert all(r.status_code == 200 for r in default + [greedy]), [r.text for r in default + [greedy]]
    texts = {r.json()["choices"][0]["message"]["content"] for r in default + [greedy]}
    assert len(texts) == 1, texts
    info = server.server_info()
    assert info["sampling_defaults"] == "model" and info["chat_template"] == "chatml"
    assert info["schedule_policy"] == "lpm" and info["random_seed"] == 3


def test_health_generate_metrics_off_and_json_errors(server):
    assert server.get("/health_generate").status_code == 200
    for method, path, status in (("GET", "/metrics", 404), ("GET", "/nothing/here", 404),
                                 ("GET", "/v1/completions", 405), ("PUT", "/tokenize", 405)):
        r = requests.request(method, server.url + path, timeout=10)
        assert r.status_code == status and r.headers["Content-Type"].startswith("application/json"), (path, r.text)
        assert path in r.json()["error"]["message"]


def test_unsupported_fields_are_400_naming_them(server):
    for path, body, param in (
        ("/generate", {"text": "w5", "session_params": {"id": "s"}}, "session_params"),
        ("/generate", {"text": "w5", "sampling_params": {"custom_params": {"a": 1}}}, "sampling_params.custom_params"),
        ("/v1/completions", {"prompt": "w5", "lora_path": "adapter"}, "lora_path"),
        ("/v1/chat/completions", {"messages": MSG, "return_hidden_states": True}, "return_hidden_states"),
    ):
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
