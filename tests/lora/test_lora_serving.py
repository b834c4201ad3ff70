"""LoRA adapters served by a real server on the default model (SmolLM2), fp32: greedy outputs
under each adapter are transformers + peft's with the adapter merged (``merge_and_unload``),
without one the base model's; a batch mixing three adapters and the base over two slots equals
each alone; the prefix cache never shares a page between adapters; bad names are 400s naming
them; bad flags fail at start naming the field. One server for the module."""

from __future__ import annotations

import pytest
import requests
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint  # noqa: E402
from pdserve.engine.text.tokenizer import load_tokenizer  # noqa: E402
from pdserve.engine.model_executor.layers.lora_adapter import LoraAdapterError  # noqa: E402
from pdserve.engine.model_executor.lora_manager import read_adapters  # noqa: E402
from pdserve.engine.server_config import ServerConfig  # noqa: E402
from support.model_util import assert_picks_agree_but_near_ties  # noqa: E402
from support.pd_stand import Server  # noqa: E402

torch.set_num_threads(1)  # the reference's forwards share the 2 cores with the server

BASE_NAME = "SmolLM2-135M-Instruct"
MAX_NEW = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
# name -> (seed, rank, target modules): three adapters over two slots, so one waits for a slot
ADAPTERS = {
    "a": (1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": (2, 4, ["q_proj", "v_proj", "down_proj"]),
    "c": (3, 16, ["o_proj", "gate_proj", "up_proj"]),
}


def _hf_base(path: str):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class MergedReference:
    """transformers on the base weights with one adapter at a time merged into them (peft's
    ``merge_and_unload``). ``check`` scores a served output in one forward, teacher-forced: each
    token must be the reference's greedy pick after the same prefix (so the whole greedy run is
    the reference's), but where its top two are a near-tie."""

    def __init__(self, base_dir: str, paths: dict[str, str]):
        self.model = _hf_base(base_dir)
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.paths = paths
        self.current: str | None = None

    def _use(self, adapter: str | None) -> None:
        if adapter == self.current:
            return
        self.model.load_state_dict(self.base_state)
        if adapter is not None:
            tuned = peft.PeftModel.from_pretrained(self.model, self.paths[adapter])
            self.model = tuned.merge_and_unload().eval()
        self.current = adapter

    def check(self, adapter: str | None, prompt: list[int], output_ids: list[int]) -> None:
        self._use(adapter)
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + output_ids[:-1]])).logits[0, len(prompt) - 1:].float()
        assert_picks_agree_but_near_ties([output_ids], [logits.argmax(-1).tolist()], [logits])


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    """The server (adapters a, b, c over two slots), the adapters' paths, the prompts' ids and the
    merged-weights reference, built while the server loads."""
    tmp = tmp_path_factory.mktemp("adapters")
    arch, weights, _ = load_model(None)  # the served GGUF, dequantized, as a transformers checkpoint
    base = str(tmp / "base")
    save_hf_checkpoint(arch, weights, base)
    del weights
    tok = load_tokenizer(None, None, None)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    model = _hf_base(base)
    paths = {}
    for name, (seed, rank, modules) in ADAPTERS.items():
        torch.manual_seed(seed)
        # random A and B (not PEFT's zero B), so that the outputs change
        cfg = peft.LoraConfig(r=rank, lora_alpha=rank / 2, target_modules=modules, init_lora_weights=False)
        peft.get_peft_model(model, cfg).save_pretrained(str(tmp / name))
        model = _hf_base(base)
        paths[name] = str(tmp / name)
    del model
    srv = Server("lora", "null", "--lora-paths", *(f"{n}={p}" for n, p in paths.items()),
                 "--max-loras-per-batch", "2", "--page-size", "4")
    try:
        ref = MergedReference(base, paths)
        yield srv.wait_ready(), paths, prompts, ref
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(stand):
    return stand[0]


@pytest.fixture(scope="module")
def refs(stand):
    return stand[1:]


def _generate(server, prompts, lora_path):
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def alone(server, refs):
    """Each adapter's (and the base's) outputs, one adapter per request."""
    prompts = refs[1]
    return {a: [o["output_ids"] for o in _generate(server, prompts, a)] for a in (None, *ADAPTERS)}


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_each_adapter_alone_equals_merged_weights(alone, refs, adapter):
    _, prompts, ref = refs
    if adapter is not None:  # the adapter changes what the model says
        assert alone[adapter] != alone[None]
    for prompt, out in zip(prompts, alone[adapter]):
        ref.check(adapter, prompt, out)


def test_batch_mixing_adapters_equals_each_alone(server, refs, alone):
    """Six sequences, three adapters and the base, in one request over two slots: the adapters
    take turns in the slots (a request waits while both are pinned) and every sequence gets its
    own adapter: the output it gets alone."""
    prompts = refs[1]
    order = ["a", None, "b", "c", "a", "c"]
    batch = [prompts[i % len(prompts)] for i in range(len(order))]
    out = _generate(server, batch, order)
    assert [o["output_ids"] for o in out] == [alone[a][i % len(prompts)] for i, a in enumerate(order)]
    server.wait_unleaked()


def test_openai_model_names_the_adapter(server, refs, alone):
    """"BASE:NAME" (SGLang), the adapter's name alone (vLLM) and lora_path select the same adapter."""
    prompts = refs[1]
    i = next(i for i in range(len(prompts)) if alone["a"][i] != alone[None][i])
    text = _generate(server, [prompts[i]], "a")[0]["text"]
    for fields in ({"model": f"{BASE_NAME}:a"}, {"model": "a"}, {"model": BASE_NAME, "lora_path": "a"}):
        r = server.post("/v1/completions", {**fields, "prompt": prompts[i], "max_tokens": MAX_NEW,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text, fields
        assert r.json()["model"] == fields["model"]
    models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [BASE_NAME, "a", "b", "c"]
    assert all(m["parent"] == BASE_NAME for m in models[1:])


def test_bf16_forward_applies_each_rows_adapter(refs, alone):
    """In bf16 (the native kernels: panels or oneDNN at prefill, gemv at these 3-row decode steps)
    a batch of two adapters and the base, teacher-forced along the fp32 server's outputs, picks
    the same tokens but at near-ties: where they differ, the served token is in bf16's top 3. The
    adapters' rows move their logits; the base row's are those of a batch without adapters."""
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from support.model_util import greedy_generate

    paths, prompts, _ = refs
    runner = ModelRunner(EngineConfig(dtype="bfloat16", max_total_tokens=512, page_size=4, max_loras_per_batch=2,
                                      lora_paths=tuple(f"{n}={p}" for n, p in paths.items())))
    runner.load_lora([(0, "a"), (1, "c")])
    order = ["a", "c", None]
    served = [alone[a][i] for i, a in enumerate(order)]
    tokens, logits = greedy_generate(runner, prompts, MAX_NEW, forced=served, lora_slots=[0, 1, -1])
    differ = 0
    for got, want, seq_logits in zip(tokens, served, logits):
        for t, (g, w) in enumerate(zip(got, want)):
            if g != w:
                differ += 1
                assert w in seq_logits[t].topk(3).indices.tolist(), (t, g, w)
    assert differ <= len(prompts) * MAX_NEW // 4
    _, base_logits = greedy_generate(runner, prompts, MAX_NEW, forced=served, lora_slots=[-1, -1, -1])
    assert [float((x - y).abs().max()) > 0.5 for x, y in zip(logits, base_logits)] == [True, True, False]


def test_prefix_cache_keyed_by_adapter(server, refs):
    """The same prompt under another adapter (or none) reuses no page; under its own it does."""
    prompt = refs[1][2] * 3  # a few pages
    server.wait_unleaked()  # flushed: nothing cached

    def cached(adapter):
        return _generate(server, [prompt], adapter)[0]["meta_info"]["cached_tokens"]

    assert cached("a") == 0
    assert cached("b") == 0
    assert cached(None) == 0
    full = (len(prompt) - 1) // 4 * 4  # whole pages of the prompt but its last token
    assert cached("a") == cached("b") == cached(None) == full


def test_unknown_adapter_is_a_400_naming_it(server):
    r = server.post("/generate", {"text": "hi", "lora_path": "nope"})
    assert r.status_code == 400 and "nope" in r.text and "lora_path" in r.text, r.text
    r = server.post("/v1/chat/completions", {"model": f"{BASE_NAME}:nope",
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "nope" in r.text and r.json()["error"]["param"] == "model", r.text
    r = server.post("/v1/completions", {"model": "other-model", "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
    r = server.post("/generate", {"input_ids": [[1, 2], [3, 4]], "lora_path": ["a"]})
    assert r.status_code == 400 and "lora_path has 1 entries for 2 prompts" in r.text, r.text


def test_flags_refused_at_start_name_the_field(refs, tmp_path):
    with pytest.raises(ValueError, match="quantization 'w8a16' is not supported with LoRA"):
        EngineConfig(lora_paths=("a=/x",), quantization="w8a16")
    with pytest.raises(ValueError, match="max_loras_per_batch must be >= 1"):
        EngineConfig(enable_lora=True, max_loras_per_batch=0)
    with pytest.raises(ValueError, match="names adapter 'a' twice"):
        EngineConfig(lora_paths=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="enable_dp_attention is not supported with enable_lora"):
        ServerConfig(engine=EngineConfig(enable_lora=True), tp_size=2, dp_size=2, enable_dp_attention=True)
    assert EngineConfig(lora_paths=["a=/x"]).enable_lora  # --lora-paths implies --enable-lora
    with pytest.raises(LoraAdapterError, match="rank 16, above --max-lora-rank 8"):
        read_adapters(EngineConfig(lora_paths=(f"c={refs[0]['c']}",), max_lora_rank=8), 30)
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        read_adapters(EngineConfig(lora_paths=(f"x={tmp_path}",)), 30)


def test_load_and_unload_at_run_time(server, refs, alone):
    """/load_lora_adapter serves a new name (here a's weights as "d"); /unload_lora_adapter
    stops serving it; the name loaded again from b's
    path runs b's weights and reuses none of the old d's cached pages."""
    paths, prompts, _ = refs
    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": paths["a"]})
    assert r.status_code == 200 and r.json()["loaded_adapters"]["d"] == paths["a"], r.text
    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": paths["b"]})
    assert r.status_code == 400 and "'d' is already loaded" in r.json()["error_message"], r.text
    assert [o["output_ids"] for o in _generate(server, prompts, "d")] == alone["a"]
    assert "d" in [m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]]

    server.wait_unleaked()
    r = server.post("/unload_lora_adapter", {"lora_name": "d"})
    assert r.status_code == 200 and "d" not in r.json()["loaded_adapters"], r.text
    r = server.post("/generate", {"text": "hi", "lora_path": "d"})
    assert r.status_code == 400 and "'d'" in r.text, r.text
    r = server.post("/unload_lora_adapter", {"lora_name": "d"})
    assert r.status_code == 400 and "'d' is not loaded" in r.json()["error_message"], r.text

    r = server.post("/load_lora_adapter", {"lora_name": "d", "lora_path": paths["b"]})
    assert r.status_code == 200, r.text
    out = _generate(server, prompts, "d")
    assert [o["output_ids"] for o in out] == alone["b"]
    assert [o["meta_info"]["cached_tokens"] for o in out] == [0, 0, 0]  # the old d's pages are not d's now
    assert server.post("/unload_lora_adapter", {"lora_name": "d"}).status_code == 200


def test_load_lora_adapter_bad_bodies_name_the_field(server, refs, tmp_path):
    r = server.post("/load_lora_adapter", {"lora_name": "e"})
    assert r.status_code == 400 and "lora_path" in r.text, r.text
    r = server.post("/load_lora_adapter", {"lora_name": "e", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error_message"], r.text
    r = server.post("/load_lora_adapter", {"lora_name": "e:f", "lora_path": refs[0]["a"]})
    assert r.status_code == 400 and "must not contain ':'" in r.json()["error_message"], r.text
    r = server.post("/load_lora_adapter", {"lora_name": "e", "lora_path": refs[0]["a"], "pinned": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pinned", r.text
    assert "e" not in [m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]]


def test_unload_of_an_adapter_in_use_is_refused_until_its_request_ends(server, refs):
    """A streaming request under "e" holds it: /unload_lora_adapter is refused naming the adapter
    and its running request; once the client hangs up (the request is aborted), it unloads."""
    paths = refs[0]
    assert server.post("/load_lora_adapter", {"lora_name": "e", "lora_path": paths["a"]}).status_code == 200
    body = {"input_ids": refs[1][0], "lora_path": "e", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data:"))  # it runs
        r = server.post("/unload_lora_adapter", {"lora_name": "e"})
        assert r.status_code == 400, r.text
        assert "'e' is in use by 1 request(s)" in r.json()["error_message"], r.text
        assert "e" in [m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]]
    server.wait_unleaked(timeout=120)  # the hang-up aborted it
    r = server.post("/unload_lora_adapter", {"lora_name": "e"})
    assert r.status_code == 200 and "e" not in r.json()["loaded_adapters"], r.text
