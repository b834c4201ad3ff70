"""The native segmented LoRA product (kernels/cpu_lora.c) against the torch forms: the kernel
alone for ranks 8, 16 and 64, merged parts, a mix of slots with empty segments and base rows,
on each instruction set this CPU runs (AVX-512 BF16, and the portable loops of an x86-64-v3
build); then whole bf16 models under LoRA: the fused decode step with the adapters' deltas
inside its one call against the same model op by op, and the op-by-op native product against
the torch forms."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.model_util import assert_picks_agree_but_near_ties, bf16_runner, greedy_generate, make_tiny_checkpoint

from pdserve.engine.model_executor.layers.lora_product import LoraHook, LoraRows, LoraStacks
from pdserve.kernels.cpu_lora import LoraKernels
from pdserve.kernels.cpu_native import cpu_flags, kernels_for, native_kernels

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

torch.set_num_threads(2)
native = native_kernels()
needs_native = pytest.mark.skipif(native is None or not native.has_gemv, reason="needs the native kernels")
SLOTS = 5


def _isas() -> list:
    if native is None:
        return []
    kernels = LoraKernels(native)
    out = [pytest.param(kernels, id=kernels.isa)]
    if kernels.isa == "avx512" and {"avx2", "fma"} <= cpu_flags():
        portable = LoraKernels(kernels_for("x86-64-v3"))
        assert portable.isa == "portable"
        out.append(pytest.param(portable, id="portable"))
    return out


def _hook(kernels: LoraKernels | None, rank: int, in_f: int, outs: tuple[int, ...], seed: int) -> LoraHook:
    """A hook over ``outs`` parts; slot 1 holds a smaller rank (zero-padded), slot 3 stays empty,
    slot 4's adapter skips the second part."""
    g = torch.Generator().manual_seed(seed)
    parts, start = [], 0
    for p, out in enumerate(outs):
        st = LoraStacks(SLOTS, rank, in_f, out)
        for slot in (0, 1, 2, 4):
            if slot == 4 and p == 1:
                st.set(slot, None, None, 2.0)
                continue
            r = rank // 2 if slot == 1 else rank
            st.set(slot, torch.randn(r, in_f, generator=g) / in_f**0.5, torch.randn(out, r, generator=g),
                   0.5 + slot)
        parts.append((slice(start, start + out), st))
        start += out
    return LoraHook(parts, swiglu=False, kernels=kernels)


def _reference(hook: LoraHook, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """The per-slot torch form in float32 over the bf16 operands, rounded once to bf16."""
    w = hook.native_weights()  # the bf16 values the kernel reads
    yf = y.float()
    for slot, idx in rows.segments:
        h = x.float()[idx] @ w.a[slot].float().T  # [n, P*r]
        start = 0
        for p, end in enumerate(w.part_end):
            r = w.bt.shape[1]
            yf[idx, start:end] += h[:, p * r:(p + 1) * r] @ w.bt[slot, :, start:end].float()
            start = end
    return yf.to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("kernels", _isas())
@pytest.mark.parametrize("rank,outs", [(8, (96, 32, 32)), (16, (80, 80)), (64, (72,))])
def test_kernel_equals_torch_form(kernels, rank, outs):
    in_f = 100  # not a multiple of 32: the masked tail of the shrink
    hook = _hook(kernels, rank, in_f, outs, seed=rank)
    out = sum(outs)
    g = torch.Generator().manual_seed(7)
    # slots 0, 1, 2, 4 and base rows, unsorted; slot 3 (empty) and no row of some slot: empty segments
    slots = torch.tensor([2, -1, 0, 4, 0, 1, -1, 2, 2, 0, 4, -1, 1])
    x = torch.randn(len(slots), in_f + 8, generator=g).to(torch.bfloat16)[:, 4:in_f + 4]  # row stride > in
    y = torch.randn(len(slots), out, generator=g).to(torch.bfloat16)
    rows = LoraRows.of(slots)
    assert hook.runs_native(x, y)
    got = hook.apply(y.clone(), x, rows)
    want = _reference(hook, y, x, rows)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    base = slots < 0
    assert torch.equal(got[base], y[base])  # base rows: not a bit changed
    assert not torch.equal(got[~base], y[~base])
    # the torch form (dense) in float32, over A and B as the stacks hold them (unrounded): apart by
    # the bf16 rounding of A and scaled B (2^-9 of deltas of ~10 here)
    ref32 = hook.apply(y.float(), x.float(), rows)
    torch.testing.assert_close(got.float(), ref32, rtol=1.6e-2, atol=0.01 * float((ref32 - y.float()).abs().max()))


@needs_native
@pytest.mark.parametrize("kernels", _isas())
def test_kernel_segments_one_slot_empty_and_none(kernels):
    hook = _hook(kernels, 8, 64, (48, 16), seed=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    y = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    for slots in ([0] * 6, [3] * 6, [-1, 3, -1, 3, 3, -1], [4, 4, 2, 2, 1, 1]):
        rows = LoraRows.of(torch.tensor(slots))
        got = kernels.add(y.clone(), x, rows.slots32() if rows else torch.tensor(slots, dtype=torch.int32),
                          hook.native_weights())
        want = _reference(hook, y, x, rows) if rows else y
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        if 3 in slots and 0 not in slots and 4 not in slots:  # the empty slot adds exactly nothing
            assert torch.equal(got, y)
    with pytest.raises(ValueError, match="below 5"):
        kernels.add(y.clone(), x, torch.tensor([0, 5, 0, 0, 0, 0], dtype=torch.int32), hook.native_weights())
    assert kernels.add(y[:0], x[:0], torch.empty(0, dtype=torch.int32), hook.native_weights()).shape == (0, 64)


@needs_native
def test_kernel_follows_a_reloaded_slot():
    kernels = LoraKernels(native)
    hook = _hook(kernels, 8, 64, (32, 32), seed=2)
    x, y = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    rows = LoraRows.of(torch.tensor([0, 1, -1]))
    before = hook.apply(y.clone(), x, rows)
    for cols, st in hook.parts:
        st.set(1, torch.randn(8, 64), torch.randn(cols.stop - cols.start, 8), 3.0)
    after = hook.apply(y.clone(), x, rows)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    torch.testing.assert_close(after.float(), _reference(hook, y, x, rows).float(), rtol=1.6e-2, atol=1e-2)


MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: the q/k/v bias before the delta
def lora_model(request, tmp_path_factory):
    """A tiny random checkpoint and three PEFT adapters: rank 8 on everything, rank 16 on q, v and
    down, rank 64 on everything."""
    path = tmp_path_factory.mktemp(f"lora_native_{request.param}")
    make_tiny_checkpoint(request.param, str(path / "base"))
    adapters = []
    for i, (rank, modules) in enumerate([(8, MODULES), (16, ["q_proj", "v_proj", "down_proj"]), (64, MODULES)]):
        torch.manual_seed(i + 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path / "base"), dtype=torch.float32)
        cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules, init_lora_weights=False)
        peft.get_peft_model(model, cfg).save_pretrained(str(path / f"a{i}"))
        adapters.append(f"a{i}={path / f'a{i}'}")
    return str(path / "base"), tuple(adapters)


def _lora_runner(lora_model, **kw):
    base, adapters = lora_model
    runner = bf16_runner(base, lora_paths=adapters, max_loras_per_batch=4, **kw)
    runner.load_lora([(0, "a0"), (1, "a1"), (2, "a2")])
    return runner


@needs_native
def test_fused_decode_under_lora_equals_op_by_op(lora_model):
    fused, ops = _lora_runner(lora_model), _lora_runner(lora_model, disable_fused_decode=True)
    assert fused.model.fused is not None and ops.model.fused is None
    # the three adapters, the base, and an empty slot (3), with panels' steps (13 rows) and gemv's (4)
    for slots in ([0, -1, 1, 2, 0, 3, 2, 1, -1, 0, 2, 2, 1], [2, 0, -1, 1]):
        prompts = [[5 + i, 9, 17 + 3 * i, 4] + [40 + i] * (i % 4) for i in range(len(slots))]
        want_tokens, want = greedy_generate(ops, prompts, 6, lora_slots=slots)
        got_tokens, got = greedy_generate(fused, prompts, 6, forced=want_tokens, lora_slots=slots)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0.1 * float(w.std()))  # bf16 roundings in another order
        assert_picks_agree_but_near_ties(got_tokens, want_tokens, want)
    assert fused.model.fused.stack.lora_layers == fused.arch.num_layers  # the deltas went in inside the call
    # the adapters change the picks: the same prompts on the base alone differ
    base_tokens, _ = greedy_generate(fused, prompts, 6, lora_slots=[-1] * len(prompts))
    assert base_tokens != got_tokens


@needs_native
def test_native_product_equals_torch_forms_op_by_op(lora_model):
    ops = _lora_runner(lora_model, disable_fused_decode=True)
    slots = [1, 0, -1, 2, 2]
    prompts = [[7 + i, 3, 11 * i + 1, 8, 9][: 3 + i % 3] for i in range(len(slots))]
    want_tokens, want = greedy_generate(ops, prompts, 5, lora_slots=slots)
    LoraHook.native = False
    try:
        got_tokens, got = greedy_generate(ops, prompts, 5, forced=want_tokens, lora_slots=slots)
    finally:
        LoraHook.native = True
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0.1 * float(w.std()))  # bf16 roundings in another order
    assert_picks_agree_but_near_ties(got_tokens, want_tokens, want)


def test_stacked_parts_cover_the_columns_in_order():
    hook = _hook(None, 8, 32, (16, 8, 8), seed=4)
    w = hook.native_weights()
    assert w.part_end == list(itertools.accumulate((16, 8, 8)))
    assert w.a.shape == (SLOTS, 3 * 8, 32) and w.bt.shape == (SLOTS, 8, 32)
    st = hook.parts[0][1]  # slot 2's q part: A's rows and B's columns, the scaling folded into B
    assert torch.equal(w.a[2, :8], st.a[2].to(torch.bfloat16))
    assert torch.equal(w.bt[2, :, :16], (st.b[2] * st.scaling[2]).T.to(torch.bfloat16))
    assert not hook.runs_native(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 32, dtype=torch.bfloat16))
