"""The router's own tokenizer, for conditional disaggregation under any prefill policy.

``--local-prefill-max-tokens`` compares a prompt's length in tokens with the limit. A policy that
tokenizes (``kv_aware``) gives the uncached part; under any other policy the router counts the
whole prompt with this tokenizer: the workers' own (``--tokenizer-path``, else the
``tokenizer_path`` or ``model_path`` a worker's ``/server_info`` names, else the default model),
loaded once on a thread so the event loop never waits for it. ``ready`` gates the router's
readiness: until it is loaded, every request would take the prefill path.
"""

from __future__ import annotations

import logging
import threading
import time

from pdserve.router.kv.kv_aware_policy import prompt_ids

log = logging.getLogger("pdserve.router.prompt_tokenizer")


class PromptTokenizer:
    def __init__(self, tokenizer_path: str | None = None):
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self._started = False
        self._lock = threading.Lock()
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self._tokenizer is not None

    def start(self, model_path: str | None) -> None:
        """Load the tokenizer on a thread (once): ``--tokenizer-path`` if given, else ``model_path``."""
        with self._lock:
            if self._started:
                return
            self._started = True
        path = self.tokenizer_path or model_path
        threading.Thread(target=self._load, args=(path,), daemon=True, name="pdserve-router-tokenizer").start()

    def _load(self, path: str | None) -> None:
        from pdserve.engine.text.tokenizer import load_tokenizer

        t0 = time.monotonic()
        try:
            self._tokenizer = load_tokenizer(path)
        except Exception as e:  # noqa: BLE001 - reported by readiness and the log
            self.error = f"cannot load the tokenizer of {path or 'the default model'}: {type(e).__name__}: {e}"
            log.error("%s; local prefill decisions need it (--tokenizer-path)", self.error)
            return
        log.info("tokenizer of %s loaded in %.1f s (local prefill decisions count prompts with it)",
                 path or "the default model", time.monotonic() - t0)

    def count(self, body: dict) -> int | None:
        """The prompt's length in tokens; None before the tokenizer is loaded, or for a batch."""
        if self._tokenizer is None:
            return None
        try:
            ids = prompt_ids(self._tokenizer, body)
        except Exception as e:  # noqa: BLE001 - a template error: the worker will say so
            log.debug("cannot tokenize the prompt: %s", e)
            return None
        return None if ids is None else len(ids)
