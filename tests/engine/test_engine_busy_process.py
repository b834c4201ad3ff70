"""The offline Engine's rank runs in a process of its own (SGLang's Engine's arrangement), so a
process whose main thread already ran torch (a notebook, a script that preprocessed) does not slow
its steps: the rank's OpenMP pool is the only one in its process. The speed figure is a benchmark
(``scripts/bench_engine_busy.py``, results/engine_busy_process.md), not a timed test: here the
mechanism is asserted."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine import Engine


@pytest.mark.timeout(300)
def test_a_busy_process_engine_steps_in_its_own_process():
    a = torch.randn(512, 512)
    for _ in range(20):  # this process's main thread now has an OpenMP pool
        a = (a @ a).tanh()
    with Engine(dtype="float32", max_total_tokens=512, num_threads=1) as engine:
        assert not engine.in_process and engine.loop is None
        pids = [p.pid for p in engine._procs.values()]
        assert len(pids) == 1 and pids[0] != os.getpid()
        with open(f"/proc/{pids[0]}/comm") as f:
            assert f.read().strip().startswith("pdserve-dp0")  # the scheduler process, not a thread here
        out = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert len(out["output_ids"]) == 4
        with pytest.raises(RuntimeError, match="rank_on_thread"):
            engine.stats()
    with pytest.raises(ValueError, match="rank_on_thread runs one rank"):
        Engine(rank_on_thread=True, dp_size=2)
