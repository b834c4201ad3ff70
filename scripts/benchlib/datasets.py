"""Benchmark workloads: the prompts sent and the output length asked of each.

Three sources, as in SGLang's ``bench_serving.py``:

- ``random``: token ids drawn from the model's vocabulary (special tokens
  left out), lengths uniform in ``[len * range_ratio, len]``;
- ``sharegpt``: a ShareGPT-format JSON file, first human turn as the prompt,
  first gpt turn's token count as the output length;
- ``shared-prefix``: groups of prompts that share one long system prompt
  (the case a prefix cache is for).

Every generator is a pure function of its arguments and a seed.
"""

from __future__ import annotations

import dataclasses
import json
import random


@dataclasses.dataclass(frozen=True)
class DatasetRow:
    """One request of a workload.

    ``prompt_ids`` is set where the prompt was made of token ids (random and
    shared-prefix): backends that accept ids send them, so the server sees
    exactly ``prompt_len`` tokens. ``prompt`` is always its text, for
    backends that take text only (chat). ``system`` is the shared system
    prompt's text (shared-prefix), sent as a system message by chat and
    already included in ``prompt``/``prompt_ids``.
    """

    prompt: str
    prompt_len: int
    output_len: int
    prompt_ids: tuple[int, ...] | None = None
    system: str | None = None
    question: str | None = None


def usable_token_ids(tokenizer) -> list[int]:
    """Vocabulary ids minus special and added tokens (``<|im_start|>`` and the like),
    which would change the prompt's structure rather than its length."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(len(tokenizer)) if i not in special]


def _lengths(rng: random.Random, n: int, full: int, range_ratio: float) -> list[int]:
    low = max(1, int(full * range_ratio))
    return [rng.randint(low, max(low, full)) for _ in range(n)]


def _random_ids(rng: random.Random, vocab: list[int], n: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def sample_random(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[DatasetRow]:
    """``num_prompts`` prompts of random token ids."""
    rng = random.Random(seed)
    vocab = usable_token_ids(tokenizer)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    rows = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = _random_ids(rng, vocab, n_in)
        rows.append(DatasetRow(tokenizer.decode(ids), n_in, n_out, tuple(ids)))
    return rows


def _sharegpt_conversations(path: str) -> list[list]:
    """The ``conversations`` list of every item of a ShareGPT file; ValueError when the file is not
    ShareGPT-shaped JSON."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    return [item["conversations"] for item in data
            if isinstance(item, dict) and isinstance(item.get("conversations"), list)]


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first gpt turn) of every conversation that has both.

    Raises ValueError when the file is not ShareGPT-shaped JSON.
    """
    pairs = []
    for turns in _sharegpt_conversations(path):
        human = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        gpt = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "gpt"), None)
        if isinstance(human, str) and isinstance(gpt, str) and human and gpt:
            pairs.append((human, gpt))
    return pairs


def load_sharegpt_turns(path: str) -> list[list[str]]:
    """The human turns, in order, of every conversation of a ShareGPT file (multi-turn workloads).

    Raises ValueError when the file is not ShareGPT-shaped JSON."""
    out = []
    for turns in _sharegpt_conversations(path):
        human = [t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"]
        human = [h for h in human if isinstance(h, str) and h]
        if human:
            out.append(human)
    return out


def sample_sharegpt(
    tokenizer,
    path: str,
    num_prompts: int,
    seed: int,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
) -> list[DatasetRow]:
    """Up to ``num_prompts`` conversations of a ShareGPT file, shuffled by ``seed``.

    As SGLang does: prompts or completions under 2 tokens are dropped (too
    short to time), and so are those that do not fit ``context_len`` (or, when
    not given, prompts over 1024 tokens and pairs over 2048).
    """
    pairs = load_sharegpt(path)
    random.Random(seed).shuffle(pairs)
    rows = []
    for human, gpt in pairs:
        if len(rows) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(human, add_special_tokens=False))
        out_len = fixed_output_len or len(tokenizer.encode(gpt, add_special_tokens=False))
        if prompt_len < 2 or out_len < 2:
            continue
        if context_len is not None:
            if prompt_len + out_len > context_len:
                continue
        elif prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        rows.append(DatasetRow(human, prompt_len, out_len))
    return rows


def sample_shared_prefix(
    tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[DatasetRow]:
    """``num_groups * prompts_per_group`` prompts; each group shares one random system
    prompt of ``system_prompt_len`` tokens followed by its own question. The order is
    shuffled so that a group's prompts do not arrive back to back."""
    rng = random.Random(seed)
    vocab = usable_token_ids(tokenizer)
    rows = []
    for _ in range(num_groups):
        sys_ids = _random_ids(rng, vocab, system_prompt_len)
        sys_text = tokenizer.decode(sys_ids)
        for _ in range(prompts_per_group):
            q_ids = _random_ids(rng, vocab, question_len)
            q_text = tokenizer.decode(q_ids)
            ids = sys_ids + q_ids
            rows.append(
                DatasetRow(tokenizer.decode(ids), len(ids), output_len, tuple(ids), system=sys_text, question=q_text)
            )
    rng.shuffle(rows)
    return rows
