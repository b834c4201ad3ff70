"""Speculation flags that cannot work refuse the start with a message naming the flag: in the config
(an unknown algorithm, draft tokens out of range, draft flags without STANDALONE or with NGRAM, an
unknown draft quantization, NGRAM windows), on the command line, and through the real ``pdserve
serve`` process for a draft model that does not load or has another vocabulary: it exits non-zero
before any rank loads weights, never at the first request. (A prefill server given the flags says
it ignores them: ``test_spec_pd_servers.py``; a draft of another tokenizer with the same vocabulary
size: ``test_draft_model.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]
# model_util.make_tiny_checkpoint's llama, its config.json alone
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
                  intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.mark.parametrize("kw,message", [
    (dict(speculative_algorithm="EAGLE"), "speculative_algorithm must be one of"),
    (dict(speculative_algorithm="ngram"), "speculative_algorithm must be one of"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0), "speculative_num_draft_tokens must be in"),
    (dict(speculative_algorithm="STANDALONE", speculative_num_draft_tokens=17), "speculative_num_draft_tokens must"),
    (dict(speculative_draft_model_path="/x"), "speculative_draft_model_path and .* need speculative_algorithm"),
    (dict(speculative_draft_quantization="w8a16"), "speculative_draft_quantization need speculative_algorithm"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"), "NGRAM uses no draft model"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_quantization="w8a16"), "NGRAM uses no draft model"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_quantization="int3"),
     "speculative_draft_quantization must be one of"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=0),
     "speculative_ngram_min_match_window_size must be >= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
          speculative_ngram_max_match_window_size=4), "speculative_ngram_max_match_window_size"),
])
def test_bad_combinations_are_refused_naming_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


@pytest.mark.parametrize("argv,message", [
    (["--speculative-algorithm", "EAGLE"], "argument --speculative-algorithm: invalid choice: 'EAGLE'"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "17"],
     "speculative_num_draft_tokens must be in [1, 16], got 17"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-quantization", "int3"],
     "argument --speculative-draft-quantization: invalid choice: 'int3'"),
])
def test_bad_flags_are_command_line_errors(argv, message, capsys):
    """``pdserve serve``'s own entry: exit status 2 and the message, before anything loads."""
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's choices
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


def test_a_draft_model_that_does_not_load_stops_pdserve_serve_at_start(tmp_path):
    """The real server process: it exits 1 naming the flag, before its ranks start."""
    missing = str(tmp_path / "missing")
    out = subprocess.run([sys.executable, "-m", "pdserve.engine", "--port", "0", "--log-level", "warning",
                          "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", missing],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    line = [x for x in out.stderr.splitlines() if "failed to start" in x]
    assert line and f"failed to start: speculative_draft_model_path {missing!r}" in line[0], out.stderr
    assert "does not exist" in line[0]


def test_the_offline_engine_refuses_a_draft_that_does_not_load_before_loading_weights(tmp_path):
    from pdserve.engine import Engine

    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"speculative_draft_model_path {missing!r} cannot serve as the draft"):
        Engine(rank_on_thread=True, speculative_algorithm="STANDALONE", speculative_draft_model_path=missing)


def test_a_draft_of_another_vocabulary_or_tp_split_is_refused_from_its_header(tmp_path):
    """What ``pdserve serve`` checks before its ranks load weights (``check_model``): the draft's
    vocabulary size against the target's, and that it splits over the TP size."""
    from pdserve.entrypoints.serve import check_draft_model
    from pdserve.engine.model_executor.model_loader import load_arch

    for name, vocab in (("target", 1024), ("draft", 512)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(dict(TINY_LLAMA, vocab_size=vocab)))
    target, draft = load_arch(str(tmp_path / "target")), tmp_path / "draft"
    with pytest.raises(ValueError, match="speculative_draft_model_path .* has a vocabulary of 512 tokens, the target "
                                         "model 1024"):
        check_draft_model(target, str(draft), 1)
    (draft / "config.json").write_text(json.dumps(dict(TINY_LLAMA, vocab_size=1024)))
    check_draft_model(target, str(draft), 2)
    with pytest.raises(ValueError, match="speculative_draft_model_path .* cannot serve as the draft: .*tp_size 3"):
        check_draft_model(target, str(draft), 3)
