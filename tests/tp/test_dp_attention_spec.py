"""Speculative decoding under DP attention: ``--tp-size 2 --dp-size 2 --enable-dp-attention`` with
``--speculative-algorithm NGRAM`` on the tiny Llama, fp32. The verify step is a target forward of
one row per fed token and draft, every row sampled, so each group announces its own verify rows
in its rounds and the groups' accept lengths differ freely. Greedy output equals TP 1 without
speculation with a batch over both groups and with one group working while the other idles;
drafts are accepted (a repetitive prompt); the pools end unleaked.

One server per algorithm: on a shared 2-core machine each stand is slow, so each test asks
everything of its one stand.
"""

from __future__ import annotations

import re

import pytest
from server_helpers import ServerProcess, post_to_groups
from test_tp_server import PROMPTS

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(600)

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
DP = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--dtype", "float32", "--max-total-tokens", "2048")


def tp1_outputs(path: str) -> list[list[int]]:
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as engine:
        return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


def dispatched(server) -> dict[str, float]:
    """pdserve_requests_total per dp_rank."""
    text = server.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_requests_total\{[^}]*dp_rank="(\d)"[^}]*\} (\S+)', text)}


def check_spec_equals_tp1(path: str, *flags: str) -> list[int]:
    """A DP-attention server on ``path`` speculating with ``flags``: a batch over both groups, then
    each group alone, greedy equal to TP 1 without speculation; pools unleaked. Returns the drafts
    each request accepted: the batch's (prompt i in group i % 2), then the repetitive prompt's in
    group 0 alone and in group 1 alone."""
    want = tp1_outputs(path)
    server = ServerProcess("--model-path", path, *DP, *flags)
    try:
        server.wait_ready()
        results = post_to_groups(server, PROMPTS, GREEDY)  # both groups at once
        assert [r.json().get("output_ids") for r in results] == want, (results[0].text, server.log())
        metas = [r.json()["meta_info"] for r in results]
        for rank in (0, 1):  # one group speculates, the other idles through its rounds
            before = dispatched(server)
            r = server.post("/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY,
                                          "routed_dp_rank": rank})
            assert r.json().get("output_ids") == want[2], (r.text, server.log())
            metas.append(r.json()["meta_info"])
            after = dispatched(server)
            assert after[str(rank)] == before.get(str(rank), 0) + 1
            assert after.get(str(1 - rank), 0) == before.get(str(1 - rank), 0)
        server.wait_idle_and_unleaked()
    finally:
        server.stop()
    return [m.get("spec_accept_token_num", 0) for m in metas]


def test_ngram_equals_tp1(tiny_checkpoints):
    accepted = check_spec_equals_tp1(tiny_checkpoints["llama"], "--speculative-algorithm", "NGRAM")
    assert sum(accepted[:len(PROMPTS)]) > 0 and all(a > 0 for a in accepted[len(PROMPTS):]), accepted
