"""Multi-turn conversations: each turn's prompt is the whole history (earlier answers included)
plus a new message, so a server that kept every earlier turn's KV computes only the new part.

The workload (``make_conversations``): N conversations of T messages, token ids either generated
(random ids of the model's vocabulary, lengths uniform in ``[len * range_ratio, len]``) or the
human turns of a ShareGPT file's multi-turn conversations (each truncated to the message length).
Answers are the server's own greedy tokens (EOS ignored, ``answer_len`` each), so the history is
what the server produced, id for id: the ``generate`` API (ids in, ids out) carries it.

``play_turns`` plays turns in lock step: the N requests of a turn are sent together, then the
think time, then the next turn (a caller restarts a server between turns). Each request's
``cached_tokens`` (``meta_info.cached_tokens``, what ``usage.prompt_tokens_details.cached_tokens``
reports on the OpenAI APIs: every prompt token not computed, whichever tier it came from) and
TTFT are recorded per turn; ``summarize`` turns the records into the hit rate against the ideal
(every earlier turn cached), prompt tokens computed and TTFT by turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time

import aiohttp

from .datasets import _random_ids, load_sharegpt_turns, usable_token_ids


@dataclasses.dataclass
class TurnRecord:
    """One request of a conversation, as the client saw it."""

    conversation: int
    turn: int  # 0-based
    prompt_len: int
    history_len: int  # tokens of the prompt that earlier turns produced (the ideal's cacheable part)
    cached_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    success: bool = False
    error: str = ""


@dataclasses.dataclass
class Conversations:
    """The messages (``messages[c][t]``: token ids) and the histories so far (prompt + answers)."""

    messages: list[list[list[int]]]
    answer_len: int
    histories: list[list[int]] = dataclasses.field(default_factory=list)
    source: str = "generated"

    def __post_init__(self):
        if not self.histories:
            self.histories = [[] for _ in self.messages]

    @property
    def num_turns(self) -> int:
        return min(len(m) for m in self.messages)


def make_conversations(tokenizer, num: int, turns: int, message_len: int, answer_len: int,
                       range_ratio: float = 1.0, seed: int = 1, sharegpt_path: str | None = None) -> Conversations:
    """``num`` conversations of ``turns`` messages. Generated: random ids, lengths uniform in
    ``[message_len * range_ratio, message_len]``. ShareGPT: the human turns of the file's
    conversations with at least ``turns`` of them, each cut to ``message_len`` tokens."""
    rng = random.Random(seed)
    if sharegpt_path:
        convs = [c for c in load_sharegpt_turns(sharegpt_path) if len(c) >= turns]
        rng.shuffle(convs)
        if len(convs) < num:
            raise ValueError(f"{sharegpt_path}: {len(convs)} conversations with >= {turns} human turns, "
                             f"{num} asked")
        messages = [[tokenizer.encode(text, add_special_tokens=False)[:message_len] or [tokenizer.eos_token_id]
                     for text in c[:turns]] for c in convs[:num]]
        return Conversations(messages, answer_len, source=f"sharegpt:{sharegpt_path}")
    vocab = usable_token_ids(tokenizer)
    low = max(1, int(message_len * range_ratio))
    messages = [[_random_ids(rng, vocab, rng.randint(low, max(low, message_len))) for _ in range(turns)]
                for _ in range(num)]
    return Conversations(messages, answer_len)


async def _one(session: aiohttp.ClientSession, url: str, rec: TurnRecord, prompt: list[int], answer_len: int,
               headers: dict | None) -> list[int]:
    """Stream one /generate request; fill ``rec``; return the answer's ids."""
    from .client import iter_sse, DONE, StreamError

    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": answer_len, "ignore_eos": True}}
    t0 = time.perf_counter()
    answer: list[int] = []
    try:
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text()).strip()[:300]}"
                return []
            async for ts, obj in iter_sse(resp):
                if obj is DONE:
                    break
                if "error" in obj:
                    raise StreamError(str(obj["error"])[:300])
                ids = obj.get("output_ids") or []
                if ids and rec.ttft is None:
                    rec.ttft = ts - t0
                answer = list(ids)  # the whole output so far (not incremental)
                meta = obj.get("meta_info") or {}
                rec.cached_tokens = int(meta.get("cached_tokens") or 0)
        rec.success = len(answer) == answer_len
        if not rec.success and not rec.error:
            rec.error = f"got {len(answer)} tokens of {answer_len}"
    except (StreamError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.latency = time.perf_counter() - t0
    return answer


async def play_turns(url: str, convs: Conversations, turns: range, *, think_time: float = 0.0,
                     headers: dict | None = None, request_timeout: float = 3600.0,
                     between_turns=None) -> list[TurnRecord]:
    """Play ``turns`` of every conversation: a turn's requests together, then ``think_time``
    seconds, then ``between_turns(t)`` if given (a callable; e.g. scrape metrics), then the next."""
    records: list[TurnRecord] = []
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        for t in turns:
            prompts = [h + m[t] for h, m in zip(convs.histories, convs.messages)]
            recs = [TurnRecord(c, t, len(p), len(h)) for c, (p, h) in enumerate(zip(prompts, convs.histories))]
            answers = await asyncio.gather(*(_one(session, url, r, p, convs.answer_len, headers)
                                             for r, p in zip(recs, prompts)))
            for c, (p, a) in enumerate(zip(prompts, answers)):
                convs.histories[c] = p + a
            records += recs
            if between_turns is not None:
                between_turns(t)
            if think_time > 0 and t != turns[-1]:
                await asyncio.sleep(think_time)
    return records


async def play_one_by_one(url: str, convs: Conversations, turns: range, *, think_time: float = 0.0,
                          request_timeout: float = 3600.0) -> list[TurnRecord]:
    """Play each conversation's ``turns`` alone, one request at a time, then the next conversation:
    a server is idle when each request comes (a new user's first try)."""
    records: list[TurnRecord] = []
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        for c in range(len(convs.histories)):
            for t in turns:
                h = convs.histories[c]
                prompt = h + convs.messages[c][t]
                rec = TurnRecord(c, t, len(prompt), len(h))
                convs.histories[c] = prompt + await _one(session, url, rec, prompt, convs.answer_len, None)
                records.append(rec)
                if think_time > 0:
                    await asyncio.sleep(think_time)
    return records


def ideal_cached(history_len: int, prompt_len: int, page_size: int) -> int:
    """Every earlier turn cached: the history's full pages, but for the KV no one computed (the
    last answer token's: decoding stops at it) and the last prompt token (always computed)."""
    return min(history_len - 1, prompt_len - 1) // page_size * page_size if history_len else 0


def summarize(records: list[TurnRecord], page_size: int) -> dict:
    """Hit rate (cached over the ideal), prompt tokens computed, and TTFT p50 by turn."""
    ok = [r for r in records if r.success]
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(ideal_cached(r.history_len, r.prompt_len, page_size) for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    by_turn = {}
    for t in sorted({r.turn for r in records}):
        rs = [r for r in ok if r.turn == t]
        ttfts = [r.ttft for r in rs if r.ttft is not None]
        by_turn[t + 1] = {  # 1-based, as people count turns
            "p50_ttft_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "cached": sum(r.cached_tokens for r in rs),
            "ideal": sum(ideal_cached(r.history_len, r.prompt_len, page_size) for r in rs),
            "prompt": sum(r.prompt_len for r in rs),
        }
    return {"requests": len(records), "failed": len(records) - len(ok), "prompt_tokens": prompt,
            "cached_tokens": cached, "ideal_cached_tokens": ideal, "computed_tokens": prompt - cached,
            "hit_rate": round(cached / ideal, 3) if ideal else None, "by_turn": by_turn,
            "errors": sorted({r.error for r in records if r.error})[:5]}


def p50_ttft_ms(records: list[TurnRecord], min_turn: int) -> float | None:
    """p50 TTFT (ms) of the successful requests at 1-based turns >= ``min_turn``."""
    ttfts = [r.ttft for r in records if r.success and r.ttft is not None and r.turn + 1 >= min_turn]
    return round(1000 * statistics.median(ttfts), 1) if ttfts else None
