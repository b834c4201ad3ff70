"""LoRA at tensor parallel 2 on a tiny random Llama, fp32: each adapter sharded as its base linear
(A whole and B's rows split for q, k, v, gate, up; A's columns split and B whole for o, down, the
delta joining the partial sums before the all-reduce). A batch mixing three adapters and the base
gives at TP 2 the outputs of TP 1, and those are transformers + peft's greedy picks, colocated
and through a TP 2 prefill and decode; an adapter loaded at run time reaches both TP ranks. One
TP 2 server for the module, and a PD pair for its test."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from pdserve.entrypoints.engine import Engine  # noqa: E402
from support.model_util import assert_picks_agree_but_near_ties, make_tiny_checkpoint  # noqa: E402
from support.pd_stand import Server, pd_post, serving  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(3, 30)), [1] + [17, 250, 3] * 6, [4, 4, 8, 15, 16, 23, 42]]
# name -> (seed, rank, target modules, rsLoRA): each sharded kind of projection, ranks apart
ADAPTERS = {
    "a": (1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "b": (2, 4, ["q_proj", "v_proj", "down_proj"], False),
    "c": (3, 16, ["k_proj", "o_proj", "gate_proj", "up_proj"], True),
}
MIXED = ["a", None, "b", "c"]  # one row each: three adapters and the base in one batch
FLAGS = dict(dtype="float32", max_loras_per_batch=3, page_size=4)


def _hf(path: str):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    """(the TP 2 server, the base checkpoint's path, the adapters' paths)."""
    tmp = tmp_path_factory.mktemp("lora-tp")
    base = str(tmp / "base")
    make_tiny_checkpoint("llama", base)
    paths = {}
    for name, (seed, rank, modules, rslora) in ADAPTERS.items():
        torch.manual_seed(seed)
        # random A and B (not PEFT's zero B), large enough to move the tiny model's picks
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False,
                              use_rslora=rslora)
        peft.get_peft_model(_hf(base), cfg).save_pretrained(str(tmp / name))
        paths[name] = str(tmp / name)
    srv = Server("lora-tp2", "null", "--model-path", base, "--tp-size", "2", "--page-size", "4",
                 "--max-loras-per-batch", "3", "--lora-paths", *(f"{n}={p}" for n, p in paths.items()))
    try:
        yield srv.wait_ready(), base, paths
    finally:
        srv.stop()


def _body(prompts, adapters) -> dict:
    return {"input_ids": prompts, "lora_path": adapters,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


def _generate(server, prompts, adapters):
    r = server.post("/generate", _body(prompts, adapters))
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


@pytest.fixture(scope="module")
def tp1_mixed(stand):
    _, base, paths = stand
    with Engine(model_path=base, lora_paths=[f"{n}={p}" for n, p in paths.items()], **FLAGS) as engine:
        out = engine.generate(input_ids=PROMPTS, lora_path=MIXED,
                              sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    return [o["output_ids"] for o in out]


def test_tp2_mixed_batch_equals_tp1_and_peft(stand, tp1_mixed):
    server, base, paths = stand
    tp2 = _generate(server, PROMPTS, MIXED)
    assert tp2 == tp1_mixed
    # the adapters change what the model says
    base_out = _generate(server, PROMPTS, [None] * len(PROMPTS))
    assert [tp2[i] != base_out[i] for i in range(len(PROMPTS))] == [a is not None for a in MIXED]
    for prompt, adapter, out in zip(PROMPTS, MIXED, tp2):  # teacher-forced: each pick is peft's
        model = _hf(base)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, paths[adapter]).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].float()
        assert_picks_agree_but_near_ties([out], [logits.argmax(-1).tolist()], [logits])
    server.wait_unleaked()


def test_adapter_loaded_at_run_time_reaches_both_ranks(stand, tp1_mixed):
    """c's weights loaded as "d" while serving give c's outputs (a rank without them would not);
    unloaded, "d" is unknown again."""
    server, _, paths = stand
    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": paths["c"]})
    assert r.status_code == 200, r.text
    assert _generate(server, [PROMPTS[3]], ["d"]) == [tp1_mixed[3]]
    server.wait_unleaked()
    assert server.post("/unload_lora_adapter", {"lora_name": "d"}).status_code == 200
    r = server.post("/generate", {"input_ids": PROMPTS[0], "lora_path": "d"})
    assert r.status_code == 400 and "'d'" in r.text, r.text


def test_pd_at_tp2_mixed_batch_equals_tp1(stand, tp1_mixed):
    """A TP 2 prefill and a TP 2 decode (each decode rank names the adapter to each prefill rank it
    takes heads from) give the mixed batch's TP 1 outputs, each request on its own room."""
    _, base, paths = stand
    flags = ("--model-path", base, "--tp-size", "2", "--page-size", "4", "--max-loras-per-batch", "3",
             "--lora-paths", *(f"{n}={p}" for n, p in paths.items()))
    servers = {"P": Server("lora-tp2-P", "prefill", *flags), "D": Server("lora-tp2-D", "decode", *flags)}
    with serving(servers) as ready:
        P, D = ready["P"], ready["D"]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda i: pd_post(P, D, "/generate", _body(PROMPTS[i], MIXED[i])),
                                    range(len(PROMPTS))))
        for (p, d), want in zip(answers, tp1_mixed):
            assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
            assert d.json()["output_ids"] == want
        P.wait_unleaked()
        D.wait_unleaked()
