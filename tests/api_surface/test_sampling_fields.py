"""A /generate body's ``sampling_params`` and an OpenAI completions body set the same SamplingParams
from the fields they share by name, and from their stop lists."""

from __future__ import annotations

import msgspec

from pdserve.engine.frontend.request_schemas import CompletionRequest, GenerateRequest
from pdserve.engine.frontend.sequences import completion_sequences, generate_sequences
from pdserve.engine.frontend.value_checks import RequestLimits

LIMITS = RequestLimits(model_names=frozenset({"m"}), max_n=4, dp_size=1, vocab_size=1000)
SHARED = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "stop_token_ids": [3, 4],
          "ignore_eos": True, "skip_special_tokens": False, "repetition_penalty": 1.1,
          "frequency_penalty": 0.2, "presence_penalty": 0.3, "stop": ["END"]}


def test_generate_and_completions_set_the_same_sampling_params_from_shared_fields():
    gen_body = {"text": "hi", "sampling_params": {"max_new_tokens": 5, **SHARED}}
    (g,), _ = generate_sequences(msgspec.json.decode(msgspec.json.encode(gen_body), type=GenerateRequest), LIMITS)
    comp_body = {"prompt": "hi", "max_tokens": 5, **SHARED}
    (c,) = completion_sequences(msgspec.json.decode(msgspec.json.encode(comp_body), type=CompletionRequest), LIMITS)
    assert g.sampling_params == c.sampling_params
    sp = g.sampling_params
    got = {k: getattr(sp, k) for k in SHARED}
    assert {**got, "stop_token_ids": list(sp.stop_token_ids), "stop": list(sp.stop)} == SHARED
    assert sp.max_new_tokens == 5
