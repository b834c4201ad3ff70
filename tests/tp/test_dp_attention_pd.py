"""PD with DP attention on the tiny Llama (fp32), over Mooncake and over NIXL: prefill P and
decode D both ``--tp-size 2 --dp-size 2 --enable-dp-attention``, and decode D2 a plain
``--tp-size 2`` (its ranks split the heads each prefill group holds whole). Each of the four
(prefill group, decode group) pairs, and each prefill group into D2, gives the colocated TP 1
output; the named decode group is the one that ran it; every pool ends unleaked. Behind the
router, a request naming its groups runs there, and short requests go to the decode group beside a
long one (the fewest tokens in flight), as the server's per-group counts show.
"""

from __future__ import annotations

import re
import threading

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, greedy_body, pd_post, wait_for

from pdserve.entrypoints.engine import Engine
from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 33, 100, 7, 8], list(range(3, 40))]
MAX_NEW = 6
DP_ATTENTION = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")


def dp_stand(backend: str, checkpoint: str, name: str, dp_flags: tuple[str, ...]):
    """A prefill and a decode server with ``dp_flags``, and a plain TP-2 decode ("D2"), over
    ``backend``: yields them ready, stops them after."""
    if backend == "nixl":
        pytest.importorskip("nixl")
    model = ["--model-path", checkpoint, "--max-total-tokens", "2048"]
    servers = {"P": Server(f"{name}-P-{backend}", "prefill", *model, *dp_flags, backend=backend),
               "D": Server(f"{name}-D-{backend}", "decode", *model, *dp_flags, backend=backend),
               "D2": Server(f"{name}-D2-{backend}", "decode", *model, "--tp-size", "2", backend=backend)}
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def stand(request, tiny_checkpoints):
    yield from dp_stand(request.param, tiny_checkpoints["llama"], "dpattn", DP_ATTENTION)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    with Engine(model_path=tiny_checkpoints["llama"], dtype="float32", max_total_tokens=2048) as engine:
        return [engine.generate(input_ids=p, sampling_params=greedy_body(p, MAX_NEW)["sampling_params"])["output_ids"]
                for p in PROMPTS]


def generate(stand, p_rank: int, decode: str, d_rank: int | None, reference) -> None:
    for ids, want in zip(PROMPTS, reference):
        pr, dr = pd_post(stand["P"], stand[decode], "/generate", greedy_body(ids, MAX_NEW), prefill_dp_rank=p_rank,
                         decode_dp_rank=d_rank)
        assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text, stand[decode].log(1500))
        assert dr.json()["output_ids"] == want


def dispatched(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_requests_total\{[^}]*dp_rank="(\d)"[^}]*\} (\S+)', text)}


@pytest.mark.parametrize("p_rank, d_rank", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_every_group_pair_equals_colocated(stand, reference, p_rank, d_rank):
    before = dispatched(stand["D"])
    generate(stand, p_rank, "D", d_rank, reference)
    after = dispatched(stand["D"])
    assert after[str(d_rank)] - before.get(str(d_rank), 0) == len(PROMPTS)
    assert after.get(str(1 - d_rank), 0) == before.get(str(1 - d_rank), 0)
    stand["P"].wait_unleaked()
    stand["D"].wait_unleaked()


def test_each_prefill_group_into_a_tp2_decode(stand, reference):
    for p_rank in (0, 1):
        generate(stand, p_rank, "D2", None, reference)
    stand["P"].wait_unleaked()
    stand["D2"].wait_unleaked()


def test_router_pairs_groups_by_tokens_and_keeps_named_ones(stand, reference):
    P, D = stand["P"], stand["D"]
    router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                          decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600))
    url = f"http://127.0.0.1:{router.port}"

    def decode_tokens() -> dict[str, int]:
        (worker,) = requests.get(url + "/workers", timeout=10).json()["decode"]
        return worker["endpoint_tokens"]

    try:
        router.wait_ready()
        before = dispatched(D)
        r = requests.post(url + "/generate", json={**greedy_body(PROMPTS[0], MAX_NEW), "routed_dp_rank": 1,
                                                   "disagg_prefill_dp_rank": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["output_ids"] == reference[0], r.text
        after = dispatched(D)
        assert after["1"] - before.get("1", 0) == 1 and after.get("0", 0) == before.get("0", 0)

        # a long request on group 0 (the first of two idle groups), then short ones while it runs
        before = after
        out = {}
        long = threading.Thread(target=lambda: out.setdefault("long", requests.post(
            url + "/generate", json=greedy_body(PROMPTS[1], 400), timeout=300)))
        long.start()
        wait_for(lambda: decode_tokens()[D.url + "@0"] > 0, 60, "the long request on decode group 0")
        shorts = [threading.Thread(target=lambda i=i: out.setdefault(i, requests.post(
            url + "/generate", json=greedy_body(PROMPTS[0], MAX_NEW), timeout=120))) for i in range(3)]
        for t in shorts:
            t.start()
        for t in shorts + [long]:
            t.join(300)
        assert [out[i].json()["output_ids"] for i in range(3)] == [reference[0]] * 3
        assert out["long"].status_code == 200, out["long"].text
        after = dispatched(D)
        assert (after["0"] - before["0"], after["1"] - before["1"]) == (1, 3)  # round robin: (2, 2)
        assert set(decode_tokens().values()) == {0}
    finally:
        router.close()
    P.wait_unleaked()
    D.wait_unleaked()
