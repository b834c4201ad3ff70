"""Reasoning parsers: a reasoning model's thinking split from its answer (``reasoning_content`` and ``content``).

Chosen by ``--reasoning-parser`` (SGLang's flag and names). A format is the pair
of markers around the thinking and whether the output starts inside it (models
whose chat template already opens the thinking in the prompt, as DeepSeek-R1's
does, write only the closing marker). ``split_reasoning`` splits a whole text;
``ReasoningStream`` splits a text as it streams, holding back a tail that may be
the start of a marker so that no marker leaks into either part.

The opening marker counts only at the start of the output (after whitespace).
As in SGLang: text after an opening marker and without its closing one is all
reasoning (the output was cut short while thinking); the answer is stripped of
the whitespace the template puts after the closing marker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str  # opens the thinking
    end: str  # closes it; the answer follows
    starts_inside: bool  # the output begins in the thinking (its opening marker is in the prompt)


THINK = ("<think>", "</think>")

# --reasoning-parser names (SGLang's)
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*THINK, starts_inside=True),
    "deepseek-v3": ReasoningFormat(*THINK, starts_inside=False),
    "glm45": ReasoningFormat(*THINK, starts_inside=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", starts_inside=False),
    "minimax": ReasoningFormat(*THINK, starts_inside=True),
    "qwen3": ReasoningFormat(*THINK, starts_inside=False),
    "qwen3-thinking": ReasoningFormat(*THINK, starts_inside=True),
    "step3": ReasoningFormat(*THINK, starts_inside=True),
}

# chat_template_kwargs keys that turn thinking off (Qwen3's, DeepSeek-V3.1's) when False
THINKING_SWITCHES = ("enable_thinking", "thinking")


def thinking_enabled(template_kwargs: dict) -> bool:
    """False when the request's ``chat_template_kwargs`` turn the model's thinking off."""
    return all(template_kwargs.get(k, True) is not False for k in THINKING_SWITCHES)


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning or None when the text has none, answer) of a choice's whole text."""
    inside = fmt.starts_inside
    head, sep, tail = text.partition(fmt.start)
    if sep and not head.strip():  # the output opens with the marker (after whitespace)
        inside, text = True, tail
    if not inside:
        return None, text
    reasoning, sep, answer = text.partition(fmt.end)
    if not sep:
        return reasoning, ""
    return reasoning, answer.lstrip()


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ReasoningStream:
    """One streamed choice's text split into (reasoning delta, answer delta) as it comes."""

    fmt: ReasoningFormat
    held: str = ""  # text not yet sent: it may be (the start of) a marker
    state: str = ""  # "": before the output shows whether it thinks; "think"; "answer"
    strip_answer: bool = False  # drop the whitespace at the start of the answer
    fresh: bool = True  # nothing sent yet: an opening marker may still come

    def __post_init__(self):
        if self.fmt.starts_inside:
            self.state = "think"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.held += text
        reasoning, answer = "", ""
        if self.state == "":
            start = self.fmt.start
            body = self.held.lstrip()
            if body.startswith(start):
                self.state, self.held, self.fresh = "think", body[len(start):], False
            elif start.startswith(body) and body and not finished:
                return "", ""  # may still become the opening marker
            elif not body and not finished:
                return "", ""
            else:
                self.state = "answer"
        if self.state == "think" and self.fresh:
            # the output may open with the marker although the prompt opened the thinking
            body = self.held.lstrip()
            if body.startswith(self.fmt.start):
                self.held, self.fresh = body[len(self.fmt.start):], False
            elif (not body or self.fmt.start.startswith(body)) and not finished:
                return "", ""
            else:
                self.fresh = False
        if self.state == "think":
            before, sep, after = self.held.partition(self.fmt.end)
            if sep:
                reasoning, self.held, self.state, self.strip_answer = before, after, "answer", True
            else:
                keep = 0 if finished else max(_held_tail(self.held, self.fmt.end), _held_tail(self.held, self.fmt.start))
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
        if self.state == "answer":
            if self.strip_answer:
                self.held = self.held.lstrip()
                if not self.held and not finished:
                    return reasoning, ""
                self.strip_answer = False
            answer, self.held = self.held, ""
        return reasoning, answer


def make_reasoning_format(name: str) -> ReasoningFormat:
    """The format of a ``--reasoning-parser`` name (``ServerConfig`` checked it)."""
    return REASONING_PARSERS[name]
