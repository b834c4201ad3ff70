"""A prefill and a decode of the same KV layout but different models (two fine-tunes of one base)
are refused at bootstrap, on both sides, with a reason naming both models; the identity itself
tells weights apart by content, not by path."""

from __future__ import annotations

import shutil

import pytest
from loop_stand import PDPair

from pdserve.engine.model_executor.model_identity import weights_fingerprint

pytestmark = pytest.mark.timeout(30)


def test_model_mismatch_is_refused_naming_both_models():
    pair = PDPair(p_engine={"model_path": "/models/finetune-a"}, d_engine={"model_path": "/models/finetune-b"})
    try:
        pair.submit("a", [1, 2, 3, 4, 5], max_new=4)
        pair.run(pair.done("a"))
        want = "model mismatch: prefill echo /models/finetune-a, decode echo /models/finetune-b"
        for side in "PD":
            out = pair.final(side, "a")
            assert out.finish_reason == "error" and want in out.error, (side, out)
        assert pair.tokens("a") == []
        pair.settle()
    finally:
        pair.close()


def test_fingerprint_follows_the_bytes_not_the_path(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 20000)
    (a / "config.json").write_text("{}")
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(copy))  # a copy on another node pairs
    raw = bytearray((copy / "model.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 1  # a fine-tune changes every tensor: its middle sample differs
    (copy / "model.safetensors").write_bytes(bytes(raw))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(copy))
