"""Speculation on the default model, colocated, through the offline Engine (fp32, in-process rank).

A request that returns logprobs decodes plainly (its per-token bookkeeping stays the plain path's),
so the same engine gives each prompt's reference: greedy outputs with NGRAM (2 branches: draft trees
where a suffix recurs with different continuations, as in the json prompt) equal it token for token,
streamed and with n > 1, and the SGLang meta_info fields count the verify steps; a json_schema
request's output with speculation is plain decoding's and valid, sampled too.
"""

from __future__ import annotations

import pytest

from pdserve.engine import Engine

PASSAGE = ("def moving_average(values, window):\n    out = []\n    for i in range(len(values) - window + 1):\n"
           "        out.append(sum(values[i:i + window]) / window)\n    return out\n")
PROMPTS = [
    f"Copy this code exactly.\n\n{PASSAGE}\nCopy:\n\n{PASSAGE[:40]}",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def engine():
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=4096, num_threads=2,
                speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, speculative_ngram_branches=2) as e:
        yield e


def test_ngram_greedy_equals_plain_on_the_default_model_streamed_and_n2(engine):
    plain = engine.generate(PROMPTS, GREEDY, return_logprob=True)
    spec = [engine.generate(p, GREEDY) for p in PROMPTS]  # batch 1: where the adaptive rule speculates
    for p, s in zip(plain, spec):
        assert s["output_ids"] == p["output_ids"]
        assert "spec_verify_ct" in s["meta_info"]
    metas = [s["meta_info"] for s in spec]
    assert sum(m["spec_accept_token_num"] for m in metas) >= 4  # copies are where prompt lookup pays
    want = plain[1]["output_ids"]
    chunks = list(engine.generate(PROMPTS[1], GREEDY, stream=True))
    assert len(chunks) > 1 and chunks[-1]["output_ids"] == want  # a chunk holds the ids so far
    assert chunks[-1]["meta_info"]["spec_verify_ct"] > 0
    both = engine.generate(PROMPTS[1], {**GREEDY, "n": 2})
    assert [b["output_ids"] for b in both] == [want, want]
    engine.check_integrity()


def test_json_schema_output_with_speculation_is_valid_and_plain(engine):
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "size"], "additionalProperties": False}
    params = {"temperature": 0.0, "max_new_tokens": 32, "json_schema": json.dumps(schema)}
    prompt = 'Records: {"name":"ab","size":3} {"name":"cd","size":4} {"name":"ef","size":5}. One more record:'
    plain = engine.generate(prompt, params, return_logprob=True)
    spec = engine.generate(prompt, params)
    assert spec["output_ids"] == plain["output_ids"]
    value = json.loads(spec["text"])
    assert set(value) == {"name", "size"} and len(value["name"]) <= 8 and 0 <= value["size"] <= 99
    assert spec["meta_info"]["spec_verify_ct"] > 0
    sampled = engine.generate(prompt, {**params, "temperature": 1.0, "seed": 3})
    json.loads(sampled["text"])
    engine.check_integrity()
