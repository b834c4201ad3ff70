"""Pure helpers of the request path: errors hidden in 200 answers, prompt-logprob merging."""

import msgspec

from pdserve.router.errors import RouterError
from pdserve.router.pd_proxy import _has_error, merge_input_logprobs


def test_error_in_a_200_answer_is_seen_in_json_and_sse():
    assert _has_error(b'{"error": {"message": "room failed"}}')
    assert _has_error(b'data: {"text": "a"}\n\ndata: {"error": {"message": "transfer failed"}}\n\n')
    assert not _has_error(b'{"text": "the word \\"error\\" in text"}')
    assert not _has_error(b'data: {"text": "a"}\n\ndata: [DONE]\n\n')
    assert not _has_error(b'{"error": null, "text": "x"}')


def test_prompt_logprobs_from_prefill_go_first():
    p = msgspec.json.encode({"meta_info": {"input_token_logprobs": [[-1, 1, None], [-2, 2, None]]}})
    d = msgspec.json.encode({"text": "x", "meta_info": {"input_token_logprobs": [[-3, 3, None]],
                                                        "output_token_logprobs": [[-4, 4, None]]}})
    out = msgspec.json.decode(merge_input_logprobs(p, d))
    assert out["meta_info"]["input_token_logprobs"] == [[-1, 1, None], [-2, 2, None], [-3, 3, None]]
    assert out["meta_info"]["output_token_logprobs"] == [[-4, 4, None]] and out["text"] == "x"
    # batched answers merge element by element
    pb = msgspec.json.encode([{"meta_info": {"input_token_logprobs": [[-1, 1, None]]}}] * 2)
    db = msgspec.json.encode([{"meta_info": {}}, {"meta_info": {"input_token_logprobs": None}}])
    assert [o["meta_info"]["input_token_logprobs"] for o in msgspec.json.decode(merge_input_logprobs(pb, db))] \
        == [[[-1, 1, None]]] * 2
    assert merge_input_logprobs(b"not json", d) == d


def test_error_body_shape():
    body = msgspec.json.decode(RouterError(429, "slow down", "rate_limit_error").body())
    assert body == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                              "code": 429}}
