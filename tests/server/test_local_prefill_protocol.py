"""A decode server started with --max-local-prefill-tokens accepts requests without bootstrap fields."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.frontend.request_schemas import GenerateRequest
from pdserve.engine.frontend.sequences import generate_sequences
from pdserve.engine.frontend.value_checks import RequestLimits

LIMITS = RequestLimits(model_names=frozenset({"default"}), max_n=8, dp_size=1, vocab_size=1000,
                       disaggregation_mode="decode")


def test_missing_bootstrap_fields_pass_only_with_local_prefill():
    req = msgspec.json.decode(b'{"text": "hi"}', type=GenerateRequest)
    with pytest.raises(RequestError) as e:
        generate_sequences(req, LIMITS)
    assert "needs bootstrap_host" in e.value.message
    (seq,), _ = generate_sequences(req, dataclasses.replace(LIMITS, max_local_prefill_tokens=16))
    assert seq.bootstrap is None
    prefill = dataclasses.replace(LIMITS, disaggregation_mode="prefill", max_local_prefill_tokens=16)
    with pytest.raises(RequestError):
        generate_sequences(req, prefill)
