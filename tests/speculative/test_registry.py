"""Proposers by --speculative-algorithm name: built from the config, a missing one named at start."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.speculative import registry
from pdserve.engine.speculative.ngram import NgramProposer


def test_ngram_is_built_with_the_window_flags():
    cfg = EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=2,
                       speculative_ngram_max_match_window_size=5)
    p = registry.create_proposer(cfg, runner=None)
    assert isinstance(p, NgramProposer) and (p.min_window, p.max_window) == (2, 5)


def test_a_proposer_missing_from_the_build_stops_the_start_naming_the_flag(monkeypatch):
    monkeypatch.setitem(registry.PROPOSERS, "NGRAM", "pdserve.engine.speculative.no_such_module:Proposer")
    with pytest.raises(ValueError, match="--speculative-algorithm NGRAM"):
        registry.create_proposer(EngineConfig(speculative_algorithm="NGRAM"), runner=None)
