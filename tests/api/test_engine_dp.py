"""The offline Engine with dp_size 2: its ranks are scheduler processes, as ``pdserve serve``
starts them; outputs equal the in-process Engine's, ``routed_dp_rank`` picks the rank, and the
control operations reach every rank."""

from __future__ import annotations

import pytest

from pdserve.engine import Engine

pytestmark = pytest.mark.timeout(600)

FLAGS = dict(dtype="float32", max_total_tokens=4096, num_threads=1)
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Roses are red, violets are", "1, 2, 3, 4,"]


def test_dp2_engine_matches_one_rank_and_controls_reach_both():
    with Engine(**FLAGS) as one:
        want = [o["output_ids"] for o in one.generate(PROMPTS, GREEDY)]
    with Engine(dp_size=2, **FLAGS) as engine:
        assert not engine.in_process
        out = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in out] == want
        assert {o["meta_info"]["dp_rank"] for o in out} == {0, 1}
        assert engine.generate(PROMPTS[0], GREEDY, routed_dp_rank=1)["meta_info"]["dp_rank"] == 1
        states = engine.get_server_info()["internal_states"]
        assert [s["dp_rank"] for s in states] == [0, 1]
        assert engine.flush_cache()
        engine.release_memory_occupation(["kv_cache"])
        refused = engine.generate(PROMPTS[:2], GREEDY)  # one prompt per rank: both refuse
        assert all(o["meta_info"]["finish_reason"]["type"] == "error" for o in refused)
        engine.resume_memory_occupation(["kv_cache"])
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == want
        with pytest.raises(RuntimeError, match="in-process rank"):
            engine.stats()
