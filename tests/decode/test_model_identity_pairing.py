"""The model identity the PD pairing compares (test_quantization_pairing.py refuses a mismatched
pair) tells weights apart by their bytes, not their path."""

from __future__ import annotations

import shutil

import pytest

from pdserve.engine.model_executor.model_identity import weights_fingerprint

pytestmark = pytest.mark.timeout(30)


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
