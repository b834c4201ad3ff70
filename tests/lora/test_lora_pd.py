"""LoRA through prefill/decode disaggregation over Mooncake (and NIXL), on a tiny random Llama, fp32: the
request's adapter runs on both sides (the prefill's first token and KV, the decode's steps), so
1P1D under two adapters and the base gives the colocated server's outputs; pages are keyed by
adapter on both sides (the prefill's prefix cache, the decode's held pages); the room's request
names the adapter, and a decode that runs another adapter under the same name is refused, as is
one that lacks it, with the pools of both sides unleaked.

Stand: the colocated reference C, prefill P and decode D serving adapters a and b, and decode D2
serving b's weights under the name a and no b; a NIXL pair for its one test."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from support.model_util import make_tiny_checkpoint  # noqa: E402
from support.pd_stand import (ADMIN_HEADERS, InProcessRouter, Server, new_room, pd_post, prompt_ids,  # noqa: E402
                              serving, wait_for)

from pdserve.router.config import RouterConfig, WorkerSpec  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 8
PAGE = 4
ADAPTERS = {"a": (1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            "b": (2, 4, ["q_proj", "v_proj", "down_proj"])}


def _ids(n: int, seed: int) -> list[int]:
    return [t % 500 + 3 for t in prompt_ids(n, seed)]  # the tiny vocabulary's ids


def _body(ids: list[int], adapter: str | None, max_new: int = MAX_NEW) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    if adapter is not None:
        body["lora_path"] = adapter
    return body


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(the tiny base checkpoint's path, {adapter: its PEFT directory})."""
    tmp = tmp_path_factory.mktemp("lora-pd")
    base = str(tmp / "base")
    make_tiny_checkpoint("llama", base)
    paths = {}
    for name, (seed, rank, modules) in ADAPTERS.items():
        torch.manual_seed(seed)
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
        model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft.get_peft_model(model, cfg).save_pretrained(str(tmp / name))
        paths[name] = str(tmp / name)
    return base, paths


def _flags(adapters) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the flags every server of the stand takes, --lora-paths of both adapters)."""
    base, paths = adapters
    return (("--model-path", base, "--page-size", str(PAGE), "--max-loras-per-batch", "2"),
            ("--lora-paths", *(f"{n}={p}" for n, p in paths.items())))


@pytest.fixture(scope="module")
def stand(adapters):
    common, both = _flags(adapters)
    paths = adapters[1]
    servers = {
        "C": Server("lora-C", "null", *common, *both),
        "P": Server("lora-P", "prefill", *common, *both),
        "D": Server("lora-D", "decode", *common, *both),
        "D2": Server("lora-D2", "decode", *common, "--lora-paths", f"a={paths['b']}"),
    }
    with serving(servers) as ready:
        yield ready


@pytest.fixture(scope="module")
def colocated(stand):
    """Greedy outputs of the colocated server, memoized per (prompt, adapter)."""
    cache: dict = {}

    def ref(ids: list[int], adapter: str | None) -> list[int]:
        key = (tuple(ids), adapter)
        if key not in cache:
            r = stand["C"].post("/generate", _body(ids, adapter))
            assert r.status_code == 200, r.text
            cache[key] = r.json()["output_ids"]
        return cache[key]

    return ref


def _received(server: Server, side: str = "decode") -> tuple[float, float]:
    """A server's rooms that succeeded and (a decode's) KV bytes received so far, over its ranks
    (/metrics)."""
    rooms = total = 0.0
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_kv_transfer_received_bytes_total"):
            total += float(line.rpartition(" ")[2])
        elif line.startswith("pdserve_kv_rooms_total") and f'side="{side}"' in line and 'state="success"' in line:
            rooms += float(line.rpartition(" ")[2])
    return rooms, total


def _received_once(server: Server, rooms: float) -> float:
    """The KV bytes received once at least ``rooms`` rooms succeeded, read twice alike: a rank's
    counters reach /metrics with its stats, which may come after the answer. At least: an earlier
    room's success may still have been on its way when the caller read its count (its bytes were
    counted before its answer, so they are in the caller's byte count already)."""
    last = [None]

    def settled() -> bool:
        now = _received(server)
        done = now[0] >= rooms and now == last[0]
        last[0] = now
        return done

    try:
        wait_for(settled, what=f"{rooms:.0f} rooms on the decode's /metrics")
    except AssertionError as e:
        raise AssertionError(f"{e}; last read (rooms, bytes): {last[0]}") from None
    return last[0][1]


def _mixed_equals_colocated(P: Server, D: Server, colocated) -> None:
    """Prompts of one token to past a 64-token chunk, under a, b and the base, sent at once so the
    decode batches them together, give the colocated outputs; every page comes back."""
    jobs = [(_ids(n, seed=n), adapter) for n in (1, 9, 70) for adapter in ("a", None, "b")]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: pd_post(P, D, "/generate", _body(*job)), jobs))
    for (ids, adapter), (p, d) in zip(jobs, answers):
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        want = colocated(ids, adapter)
        assert p.json()["output_ids"] == want[:1]
        assert d.json()["output_ids"] == want, adapter
    # the adapters change what the model says
    for ids in {tuple(ids) for ids, _ in jobs if len(ids) > 1}:
        assert len({tuple(colocated(list(ids), a)) for a in ("a", "b", None)}) == 3
    P.wait_unleaked()
    D.wait_unleaked()


def test_1p1d_two_adapters_mixed_equals_colocated(stand, colocated):
    _mixed_equals_colocated(stand["P"], stand["D"], colocated)


def test_1p1d_over_nixl_equals_colocated(adapters, colocated):
    common, both = _flags(adapters)
    servers = {"P": Server("lora-PN", "prefill", *common, *both, backend="nixl"),
               "D": Server("lora-DN", "decode", *common, *both, backend="nixl")}
    with serving(servers) as ready:
        _mixed_equals_colocated(ready["P"], ready["D"], colocated)


def test_router_forwards_the_adapter(stand, colocated):
    P, D = stand["P"], stand["D"]
    router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                          decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600))
    try:
        router.wait_ready()
        ids = _ids(12, seed=5)
        r = requests.post(f"http://127.0.0.1:{router.port}/generate", json=_body(ids, "b"), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == colocated(ids, "b")
    finally:
        router.close()
    P.wait_unleaked()
    D.wait_unleaked()


def test_same_prompt_under_two_adapters_shares_no_page(stand, colocated):
    """The prefill's prefix cache (its cached tokens) and the decode's held pages (the KV bytes it
    receives) hit only under the adapter that computed them."""
    P, D = stand["P"], stand["D"]
    P.wait_unleaked()
    D.wait_unleaked()  # flushed: nothing cached
    ids = _ids(6 * PAGE, seed=11)  # 6 pages
    # every room P sent to D so far counted on D's /metrics (the earlier tests' last ones may lag)
    wait_for(lambda: _received(D)[0] == _received(P, "prefill")[0], what="the decode's rooms equal the prefill's")

    def run(adapter):
        rooms, before = _received(D)
        p, d = pd_post(P, D, "/generate", _body(ids, adapter))
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert d.json()["output_ids"] == colocated(ids, adapter)
        return d.json()["meta_info"]["cached_tokens"], _received_once(D, rooms + 1) - before

    first_a = run("a")
    assert first_a[0] == 0 and first_a[1] > 0
    assert run("b") == first_a  # nothing of a's pages, on either side
    assert run(None) == first_a
    cached, received = run("a")
    assert cached == 5 * PAGE  # the prefill's cache: all pages but the one holding the last token
    assert 0 < received < first_a[1]  # the decode holds a's leading pages: the prefill sends the rest
    P.wait_unleaked()
    D.wait_unleaked()


def test_decode_lacking_the_adapter_refuses_it(stand):
    """Directly and through a router that does not load adapters on demand: a 400 naming the adapter;
    the prefill's room ends too."""
    P, D2 = stand["P"], stand["D2"]
    p, d = pd_post(P, D2, "/generate", _body(_ids(10, seed=3), "b"))
    assert d.status_code == 400 and "'b'" in d.text and "lora_path" in d.text, d.text
    assert p.status_code != 200  # its room never got a destination
    router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                          decode=(WorkerSpec(D2.url, "decode"),), health_check_interval_secs=3600,
                                          lora_load_on_demand=False))  # else the router loads b onto D2
    try:
        router.wait_ready()
        r = requests.post(f"http://127.0.0.1:{router.port}/generate", json=_body(_ids(10, seed=3), "b"), timeout=120)
        assert r.status_code == 400 and "'b'" in r.text, r.text
    finally:
        router.close()
    P.wait_unleaked()
    D2.wait_unleaked()


def test_decode_running_another_adapter_under_the_name_refuses_the_room(stand):
    """D2's "a" is b's weights: the room's request names another lora id than the prefill's, and
    both legs fail naming the adapter; no KV is written, every page comes back."""
    P, D2 = stand["P"], stand["D2"]
    before = _received(D2)[1]
    p, d = pd_post(P, D2, "/generate", _body(_ids(10, seed=4), "a"))
    for leg in (p, d):
        assert leg.status_code >= 400, leg.text
        assert "LoRA adapter mismatch" in leg.text and "'a'" in leg.text, leg.text
    assert _received(D2)[1] == before
    P.wait_unleaked()
    D2.wait_unleaked()


def test_decode_refuses_to_unload_an_adapter_a_room_waits_under(stand):
    """A decode leg whose prefill leg never comes waits for its KV under b: b cannot be unloaded
    from the decode meanwhile; the request aborted, every page comes back and b stays served."""
    P, D = stand["P"], stand["D"]
    body = dict(_body(_ids(10, seed=6), "b"), rid="lora-pd-held", bootstrap_host=P.host,
                bootstrap_port=P.bootstrap_port, bootstrap_room=new_room())
    with cf.ThreadPoolExecutor(1) as pool:
        leg = pool.submit(D.post, "/generate", body)
        wait_for(lambda: any(s["inflight"] for s in D.states()), what="the decode leg sent to its rank")
        r = D.post("/unload_lora_adapter", {"lora_name": "b"})
        assert r.status_code == 400 and "'b' is in use by 1 request(s)" in r.json()["error_message"], r.text
        D.post("/abort_request", {"rid": "lora-pd-held"}, headers=ADMIN_HEADERS)
        assert leg.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    D.wait_unleaked(timeout=60)
    P.wait_unleaked()
    assert "b" in [m["id"] for m in requests.get(D.url + "/v1/models", timeout=10).json()["data"]]
