"""Incremental detokenization and stop handling with the default model's real tokenizer."""

from __future__ import annotations

import pytest

from pdserve.engine.text.detokenizer import Detokenizer, IncrementalDecoder
from pdserve.engine.sched.request import Req
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.stop_checker import StopChecker
from pdserve.engine.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


TEXT = "héllo 世界 🎉 ok. Then: END here"


def test_never_emits_broken_utf8(tok):
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters
    dec = IncrementalDecoder(tok)
    pieces = [dec.feed([i]) for i in ids]
    pieces.append(dec.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == TEXT


def test_stop_string_trimmed_and_never_streamed(tok):
    ids = tok.encode(TEXT)
    d = Detokenizer(tok, stop=["END"])
    streamed = "".join(d.feed([i]) for i in ids)
    assert "E" not in streamed.split("Then:")[-1]  # the possible start of "END" was held back
    final = streamed + d.finish("END")
    assert final == "héllo 世界 🎉 ok. Then: "
    assert d.text == final


def test_no_stop_gives_full_text(tok):
    ids = tok.encode(TEXT)
    d = Detokenizer(tok, stop=["zzz"])
    assert "".join(d.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + d.finish(None) == TEXT


def test_stop_checker_rules(tok):
    ids = tok.encode(TEXT)
    check = StopChecker(eos_token_ids=[tok.eos_token_id], tokenizer=tok)

    def run(sp, seq):
        r = Req("r", [1], sp)
        for t in seq:
            r.output_ids.append(t)
            reason = check(r)
            if reason:
                return len(r.output_ids), reason
        return None

    n, reason = run(SamplingParams(stop=["END"]), ids)
    assert reason.type == "stop" and reason.matched == "END"
    assert tok.decode(ids[:n]).endswith("END")
    eos = tok.eos_token_id
    assert run(SamplingParams(), [5, eos, 6])[1].matched == eos
    assert run(SamplingParams(ignore_eos=True, max_new_tokens=3), [5, eos, 6])[1].type == "length"
    assert run(SamplingParams(stop_token_ids=[6]), [5, 6])[1].matched == 6
    assert run(SamplingParams(max_new_tokens=2), [5, 6, 7])[0] == 2
    assert run(SamplingParams(min_new_tokens=2), [eos, eos, 5])[0] == 2
