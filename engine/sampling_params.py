"""Sampling parameters, with SGLang's names. Validated at the boundary."""

from __future__ import annotations

import msgspec

from pdserve.engine.constrained.grammar_spec import GRAMMAR_FIELDS

# most top logprobs one output token may carry: the API's limit, and the size of a PD aux slot's list
MAX_TOP_LOGPROBS = 20


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    # structured output (SGLang's names): at most one; json_schema is the schema's JSON text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # a reasoning budget: after this many output tokens still thinking, thinking_end (the reasoning
    # format's closing marker) is forced; both set by the chat front end under --reasoning-parser
    thinking_budget: int | None = None
    thinking_end: str | None = None
    thinking_start: str | None = None  # the opening marker the output must begin with; None: it starts inside

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.thinking_budget is not None and (self.thinking_budget < 0 or not self.thinking_end):
            raise ValueError(f"thinking_budget must be >= 0 with a thinking_end, got {self.thinking_budget}")
        given = [kind for kind in GRAMMAR_FIELDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]} cannot be combined with {given[0]}: give at most one grammar")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids has {t}, outside the vocabulary [0, {vocab_size})")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar that constrains the output, or None."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
