"""Structured output through 1P1D behind the router: prefill samples the first token under the
grammar, decode continues the grammar from it (its matcher replays that token first)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from structured_util import MAX_TOKENS, TWENTY_SCHEMAS, check_json, check_schemas, generate_text

pytestmark = pytest.mark.timeout(900)


@settings(max_examples=1, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schemas=TWENTY_SCHEMAS)
def test_random_schemas_validate_through_1p1d(structured_pd, schemas):
    url, P, D = structured_pd
    check_schemas(url, schemas)
    P.wait_unleaked()
    D.wait_unleaked()


def test_first_token_continues_on_decode(structured_pd):
    """A grammar whose first token is forced: decode must not ask for it again (``{{`` or ``AA``)."""
    url = structured_pd[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    for stream in (False, True):
        text, meta = generate_text(url, {"text": "JSON:", "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_TOKENS, "json_schema": json.dumps(schema)}}, stream)
        check_json(text, schema)
        text, _ = generate_text(url, {"text": "Code:", "sampling_params": {
            "temperature": 0.7, "max_new_tokens": 16, "regex": "A[0-9]{3}"}}, stream)
        assert re.fullmatch("A[0-9]{3}", text), text
