"""Incremental detokenization: token ids in, text out, one request at a time.

``IncrementalDecoder`` never emits half a UTF-8 character: a byte-level token
can end in the middle of a multi-byte character, which decodes to U+FFFD until
the next token completes it, so text is held back while it ends in U+FFFD.
Re-decoding a short window (from the previous read point) rather than single
tokens keeps tokenizers that merge spaces across tokens right.

``Detokenizer`` adds stop strings: text that could still turn out to be the
start of a stop string is held back, and at the end the text is cut before
the stop string that ended the request, so a stop string never reaches the
client.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.engine.text.stop_prefix import StopPrefixTracker


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text they completed (may be empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is held back, even an incomplete character."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta


class Detokenizer:
    """Text of one request's output, streamed safely and trimmed at its stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self._prefixes = StopPrefixTracker(self.stop)
        self._tracked = 0  # characters of decoder.text fed to _prefixes
        self.emitted = 0  # characters of decoder.text already returned
        self.done = False

    def feed(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that can be shown now."""
        self.decoder.feed(new_ids)
        text = self.decoder.text
        self._prefixes.feed(text[self._tracked :])
        self._tracked = len(text)
        safe = len(text) - self._prefixes.holdback()
        for s in self.stop:
            i = text.find(s, max(self.emitted - len(s) + 1, 0))
            if i != -1:
                safe = min(safe, i)
        return self._emit(safe)

    def finish(self, matched_stop: str | None = None) -> str:
        """The request ended: return the rest of the text, cut before ``matched_stop``."""
        self.decoder.flush()
        text = self.decoder.text
        end = len(text)
        if matched_stop:
            i = text.find(matched_stop)
            if i != -1:
                end = i
        self.done = True
        return self._emit(end)

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.decoder.text[self.emitted : upto]
        self.emitted = upto
        return out

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self.decoder.text[: self.emitted]
