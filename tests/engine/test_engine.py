"""The offline Engine on the real default model (SmolLM2-135M), fp32 where exactness matters.

One engine per module; few, short generations.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import Engine
from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.sampling_params import MAX_TOP_LOGPROBS

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "In machine learning, a transformer is a neural network architecture that",
    "Hello",
    "List three colors:",
    "The meaning of life is",
    "import numpy as np\nx = np.",
    "Translate to French: cheese =>",
    "My favourite food is pizza because it is cheesy, warm and",
    "Q: What is 2 + 2?\nA:",
    "Roses are red, violets are",
    "The first man on the moon was",
]


@pytest.fixture(scope="module")
def engine():
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=8192, num_threads=2) as e:
        yield e


def test_same_greedy_output_alone_and_in_batch_of_16(engine):
    batch = engine.generate(PROMPTS, GREEDY)
    engine.check_integrity()
    assert engine.flush_cache()
    for prompt, res in zip(PROMPTS, batch):
        alone = engine.generate(prompt, GREEDY)
        assert alone["output_ids"] == res["output_ids"], prompt
        assert alone["text"] == res["text"]
        assert res["meta_info"]["completion_tokens"] == 8
        assert res["meta_info"]["finish_reason"] == {"type": "length"}
    assert batch[0]["text"].startswith(" Paris")
    engine.check_integrity()


def test_seeded_sampling_reproducible(engine):
    sp = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "max_new_tokens": 8, "seed": 1234, "ignore_eos": True}
    a = engine.generate("Once upon a time", sp)
    b = engine.generate("Once upon a time", sp)
    assert a["output_ids"] == b["output_ids"]
    # inside a batch with unseeded neighbours: still the same tokens
    batch = engine.generate(["Hello", "Once upon a time", "Water"], [{"temperature": 1.0, "max_new_tokens": 8}, sp, {"temperature": 1.0, "max_new_tokens": 8}])
    assert batch[1]["output_ids"] == a["output_ids"]
    several = engine.generate("Once upon a time", {**sp, "n": 3})
    assert [r["output_ids"] for r in several][0] == a["output_ids"] and len(several) == 3
    others = {tuple(engine.generate("Once upon a time", {**sp, "seed": s})["output_ids"]) for s in range(4)}
    assert len(others | {tuple(a["output_ids"])}) > 1  # seeds matter
    engine.check_integrity()


def test_prefix_cache_hit_same_output(engine):
    prompt = "Here is a long shared instruction that many requests start with. " * 4
    a = engine.generate(prompt, GREEDY)
    b = engine.generate(prompt, GREEDY)
    assert a["meta_info"]["cached_tokens"] == 0
    n = a["meta_info"]["prompt_tokens"]
    assert b["meta_info"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    assert b["output_ids"] == a["output_ids"]
    engine.check_integrity()


def test_abort_frees_pages(engine):
    engine.flush_cache()
    total = engine.stats().num_total_pages
    stream = engine.generate(
        "Count: 1, 2, 3,", {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}, stream=True, rid="to-abort"
    )
    chunks = [next(stream), next(stream)]
    assert engine.stats().num_running == 1
    engine.abort("to-abort")
    chunks.extend(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(chunks[-1]["output_ids"]) < 500  # chunks are cumulative: the last holds every token
    engine.check_integrity()
    engine.flush_cache()
    assert engine.stats().num_free_pages == total


def test_abort_reaches_the_loop_before_a_later_call(engine):
    stream = engine.generate(
        "Count: 1, 2, 3,", {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}, stream=True, rid="ordered"
    )
    next(stream)
    engine.abort("ordered")
    assert engine.call(lambda: "ordered" not in engine.loop.scheduler.reqs)
    assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.check_integrity()


def test_stop_string_trimmed_and_logprobs(engine):
    full = engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert full["text"].startswith(" 5, 6")
    res = engine.generate(
        "1, 2, 3, 4,",
        {"temperature": 0, "max_new_tokens": 8, "stop": [" 6"]},
        return_logprob=True,
        top_logprobs_num=2,
    )
    assert res["text"] == " 5,"
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 6"}
    lps = res["meta_info"]["output_token_logprobs"]
    tops = res["meta_info"]["output_top_logprobs"]
    assert len(lps) == len(tops) == len(res["output_ids"])
    for (lp, tok, _), top in zip(lps, tops):
        assert len(top) == 2 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5 and lp <= 0


def test_prompt_logprobs(engine):
    prompt = "The capital of France is"
    first = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1}, return_logprob=True)
    tok, lp = first["output_ids"][0], first["meta_info"]["output_token_logprobs"][0][0]
    ids = engine.tokenizer.encode(prompt) + [tok]
    sp = {"temperature": 0, "max_new_tokens": 1}
    res = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    inp = res["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None
    assert all(x[0] <= 0 for x in inp[1:])
    assert abs(inp[-1][0] - lp) < 1e-3  # scoring the generated token as a prompt token agrees
    tail = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True, logprob_start_len=3)
    got = tail["meta_info"]["input_token_logprobs"]
    assert len(got) == len(ids) - 3 and all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, inp[3:]))


def test_async_generate_and_stream(engine):
    async def main():
        one = await engine.async_generate("The capital of France is", GREEDY)
        pieces = []
        async for chunk in await engine.async_generate("The capital of France is", GREEDY, stream=True):
            pieces.append(chunk)
        return one, pieces

    one, pieces = asyncio.run(main())
    # SGLang's Engine streams cumulative chunks (the incremental form: tests/api/test_engine_pd_pair.py)
    for a, b in zip(pieces, pieces[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert pieces[-1]["text"] == one["text"]
    assert pieces[-1]["output_ids"] == one["output_ids"]
    assert pieces[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"max_token": 3}}, "max_token"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["ok", ""]}, "prompt"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1] * 9000}, "context"),
    ],
)
def test_bad_parameters_raise_value_error(engine, kwargs, name):
    with pytest.raises(ValueError, match=name):
        engine.generate(**kwargs)


def test_engine_validates_as_the_server_does(engine):
    # the server's checks (protocol and tokenizer manager), raised as RequestErrors naming the field
    with pytest.raises(RequestError) as e:
        engine.generate("hi", {"max_new_tokens": 4}, return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS + 1)
    assert e.value.param == "top_logprobs_num"
    with pytest.raises(RequestError) as e:
        engine.generate(input_ids=[1] * 8000, sampling_params={"max_new_tokens": 500})
    assert e.value.code == "context_length_exceeded" and e.value.param == "sampling_params.max_new_tokens"
    with pytest.raises(RequestError) as e:
        engine.generate(["a", "b"], rid="same")
    assert e.value.param == "rid"
    engine.check_integrity()


def test_a_dead_loop_fails_calls_in_flight_and_later_ones():
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=2048, num_threads=2) as dying:
        stream = dying.generate("Count: 1, 2,", {"max_new_tokens": 100, "ignore_eos": True}, stream=True)
        next(stream)

        def broken_step():
            raise MemoryError("injected")

        dying.loop.step = broken_step
        with pytest.raises(RuntimeError, match="injected"):
            list(stream)
        with pytest.raises(RuntimeError, match="injected"):
            dying.generate("hi")


def test_shutdown_ends_streams_in_flight_and_refuses_new_calls():
    with Engine(dtype="float32", max_total_tokens=2048, num_threads=2) as closing:
        stream = closing.generate("Count: 1, 2,", {"max_new_tokens": 100, "ignore_eos": True}, stream=True)
        next(stream)
        closing.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            list(stream)
        with pytest.raises(RuntimeError, match="shut down"):
            closing.generate("hi")


def test_bad_engine_arguments():
    with pytest.raises(ValueError, match="model_path"):
        Engine(model_path="/no/such/model.gguf")
    with pytest.raises(ValueError, match="page_sise"):
        Engine(page_sise=16)


def test_mixed_chunk_same_greedy_output_as_alone():
    # chunks of 64 tokens: the long prompt takes several steps, which also carry the short ones' decodes
    long_prompt = " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(60))
    prompts = PROMPTS[:4] + [long_prompt]
    with Engine(rank_on_thread=True, dtype="float32", max_total_tokens=8192, num_threads=2, chunked_prefill_size=64,
                enable_mixed_chunk=True) as mixed:
        together = mixed.generate(prompts, GREEDY)
        mixed.check_integrity()
        assert together[-1]["meta_info"]["prompt_tokens"] > 4 * 64
        for prompt, res in zip(prompts, together):
            assert mixed.flush_cache()
            assert mixed.generate(prompt, GREEDY)["output_ids"] == res["output_ids"], prompt[:40]
        mixed.check_integrity()
