"""LoRA layers against ``peft`` on a tiny random Llama: a PEFT checkpoint read as written, and the
segmented product of a batch mixing three adapters and the base model equal to peft's modules."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from pdserve.engine.model_executor.layers.lora_adapter import (  # noqa: E402
    LORA_MODULES,
    LoraAdapterError,
    load_lora_adapter,
)
from pdserve.engine.model_executor.layers.lora_product import LoraStacks, segments_of  # noqa: E402
from pdserve.engine.model_executor.layers.lora_slots import AdapterInUse, LoraSlots, LoraSlotsFull  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _base(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def _adapter(tmp_path, name, rank, seed, modules=LORA_MODULES, rslora=False):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(modules), init_lora_weights=False,
                          use_rslora=rslora)
    model = peft.get_peft_model(_base(), cfg)
    path = tmp_path / name
    model.save_pretrained(str(path))
    return str(path), model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    return [_adapter(tmp, "a", 8, 1), _adapter(tmp, "b", 4, 2, ("q_proj", "v_proj", "down_proj")),
            _adapter(tmp, "c", 16, 3, rslora=True)]


def _peft_module(model, layer, module):
    block = model.base_model.model.model.layers[layer]
    return getattr(block.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, module)


def test_checkpoint_read_as_peft_wrote_it(adapters):
    path, model = adapters[0]
    a = load_lora_adapter("a", path, max_rank=16)
    assert a.rank == 8 and a.scaling == 2.0 and a.modules == set(LORA_MODULES)
    assert len(a.weights) == CONFIG["num_hidden_layers"] * len(LORA_MODULES)
    mod = _peft_module(model, 1, "gate_proj")
    A, B = a.weights[(1, "gate_proj")]
    assert torch.equal(A, mod.lora_A["default"].weight) and torch.equal(B, mod.lora_B["default"].weight)
    c = load_lora_adapter("c", adapters[2][0], max_rank=16)
    assert c.scaling == pytest.approx(32 / 16 ** 0.5)  # rsLoRA


@pytest.mark.parametrize("module", LORA_MODULES)
def test_mixed_batch_equals_peft(adapters, module):
    loaded = [load_lora_adapter(n, p, max_rank=16) for n, (p, _) in zip("abc", adapters)]
    ref = _peft_module(adapters[0][1], 0, module).base_layer
    out_f, in_f = ref.weight.shape
    stacks = LoraStacks(slots=4, r_max=16, in_features=in_f, out_features=out_f)
    for slot, ad in zip((2, 0, 3), loaded):  # slot order unrelated to load order
        ab = ad.weights.get((0, module))
        stacks.set(slot, *(ab or (None, None)), ad.scaling)
    torch.manual_seed(7)
    x = torch.randn(9, in_f)
    row_slots = torch.tensor([2, -1, 0, 3, 2, -1, 3, 0, 2])  # a, base, b, c, a, base, c, b, a
    y = stacks.add_delta(x @ ref.weight.T, x, segments_of(row_slots))
    by_slot = {2: adapters[0][1], 0: adapters[1][1], 3: adapters[2][1]}
    with torch.no_grad():
        for i, slot in enumerate(row_slots.tolist()):
            want = ref(x[i:i + 1]) if slot < 0 else _peft_module(by_slot[slot], 0, module)(x[i:i + 1])
            torch.testing.assert_close(y[i:i + 1], want, rtol=1e-5, atol=1e-5)


def test_refusals_name_the_setting(adapters, tmp_path):
    path = adapters[2][0]
    with pytest.raises(LoraAdapterError, match="rank 16, above --max-lora-rank 8"):
        load_lora_adapter("c", path, max_rank=8)
    with pytest.raises(LoraAdapterError, match="targets .*not among --lora-target-modules"):
        load_lora_adapter("c", path, max_rank=16, target_modules=("q_proj",))
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        load_lora_adapter("x", str(tmp_path), max_rank=16)
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(LoraAdapterError, match="use_dora"):
        load_lora_adapter("dora", str(bad), max_rank=16)


def test_slots_evict_least_recent_and_never_in_use():
    slots = LoraSlots(2)
    assert slots.acquire("a") == (0, None) and slots.acquire("b") == (1, None)
    with pytest.raises(LoraSlotsFull):
        slots.acquire("c")  # both pinned by running requests
    slots.release("a")
    assert slots.acquire("c") == (0, "a")  # a, unpinned, made room
    with pytest.raises(AdapterInUse):
        slots.unload("b")
    slots.release("b")
    slots.release("c")
    assert slots.acquire("c") == (0, None)  # still loaded: no eviction
    slots.release("c")
    assert slots.unload("b") == 1 and slots.slot_of("b") is None
    slots.check_integrity()
