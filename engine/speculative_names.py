"""Speculative decoding's names and flag checks (SGLang's ``--speculative-*``), importable without torch.

The proposers themselves live in ``engine/speculative/``; this module is what the configs and the
CLI need to name and validate them.
"""

from __future__ import annotations

from pdserve.engine.quantization_names import QUANTIZATIONS

NGRAM, STANDALONE, NEXTN = "NGRAM", "STANDALONE", "NEXTN"
SPECULATIVE_ALGORITHMS = (NGRAM, STANDALONE, NEXTN)
MAX_DRAFT_TOKENS = 16  # per sequence and step: the verify step's query rows grow with it
MAX_NGRAM_BRANCHES = 8  # NGRAM's candidate continuations merged into a draft tree


def check_speculative(algorithm: str | None, num_draft_tokens: int, draft_model_path: str | None,
                      draft_quantization: str | None, ngram_min_window: int, ngram_max_window: int,
                      ngram_branches: int = 1) -> None:
    """Raise ValueError naming the ``speculative_*`` field that is out of range or cannot combine."""
    if not 1 <= ngram_branches <= MAX_NGRAM_BRANCHES:
        raise ValueError(f"speculative_ngram_branches must be in [1, {MAX_NGRAM_BRANCHES}], got {ngram_branches}")
    if algorithm is None:
        if draft_model_path is not None or draft_quantization is not None:
            raise ValueError("speculative_draft_model_path and speculative_draft_quantization need "
                             f"speculative_algorithm {STANDALONE}")
        return
    if algorithm not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algorithm!r} "
                         "(SGLang's EAGLE and EAGLE3 are not implemented)")
    if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {num_draft_tokens}")
    if algorithm in (NGRAM, NEXTN) and (draft_model_path is not None or draft_quantization is not None):
        raise ValueError(f"speculative_algorithm {algorithm} uses no draft model: drop "
                         "speculative_draft_model_path and speculative_draft_quantization")
    if draft_quantization is not None and draft_quantization not in QUANTIZATIONS:
        raise ValueError(f"speculative_draft_quantization must be one of {QUANTIZATIONS}, got {draft_quantization!r}")
    if not 1 <= ngram_min_window <= ngram_max_window:
        raise ValueError("speculative_ngram_min_match_window_size must be >= 1 and <= "
                         f"speculative_ngram_max_match_window_size, got {ngram_min_window} and {ngram_max_window}")
