"""The stacked forms of the LoRA product (every part and slot stacked, rows masked to their slot;
one slot's parts stacked when every row is on it) give each row the delta of the per-slot form,
for a mix of adapters and the base and for one adapter alone, and follow a slot loaded again."""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.lora_product import LoraHook, LoraRows, LoraStacks


def _hook(seed: int, slots: int = 4, r: int = 4, in_f: int = 256, outs=(128, 64, 64)):
    g = torch.Generator().manual_seed(seed)
    parts, start = [], 0
    for out in outs:
        st = LoraStacks(slots, r, in_f, out)
        for slot in range(slots - 1):  # the last slot stays empty
            rank = r if slot % 2 == 0 else r // 2  # a smaller rank is padded with zeros
            st.set(slot, torch.randn(rank, in_f, generator=g), torch.randn(out, rank, generator=g), 0.5 + slot)
        parts.append((slice(start, start + out), st))
        start += out
    return LoraHook(parts, swiglu=False), start


def _per_slot(hook: LoraHook, y: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    y = y.clone()
    for cols, st in hook.parts:
        st.add_delta(y[:, cols], x, rows.segments)
    return y


def test_dense_equals_per_slot_for_a_mix():
    hook, out = _hook(0)
    torch.manual_seed(1)
    x, y = torch.randn(7, 256), torch.randn(7, out)
    rows = LoraRows.of(torch.tensor([0, -1, 1, 2, 0, 3, -1]))
    assert rows.mixed and hook._dense_pays(256, out)
    want = _per_slot(hook, y, x, rows)
    got = hook.apply(y.clone(), x, rows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(want, y)  # the adapters moved the rows they apply to
    torch.testing.assert_close(got[[1, 6]], y[[1, 6]], rtol=0, atol=0)  # base rows: no delta at all


def test_dense_follows_a_reloaded_slot():
    hook, out = _hook(0)
    x, y = torch.randn(3, 256), torch.randn(3, out)
    rows = LoraRows.of(torch.tensor([0, 1, -1]))
    hook.apply(y.clone(), x, rows)  # builds the stacked copies
    for cols, st in hook.parts:
        st.set(1, torch.randn(4, 256), torch.randn(cols.stop - cols.start, 4), 3.0)
    torch.testing.assert_close(hook.apply(y.clone(), x, rows), _per_slot(hook, y, x, rows), rtol=1e-4, atol=1e-4)


def test_one_adapter_on_every_row_equals_per_slot():
    hook, out = _hook(2)
    x, y = torch.randn(5, 256), torch.randn(5, out)
    for slot in (0, 1, 3):  # 3: an empty slot adds nothing
        rows = LoraRows.of(torch.tensor([slot] * 5))
        assert not rows.mixed
        torch.testing.assert_close(hook.apply(y.clone(), x, rows), _per_slot(hook, y, x, rows),
                                   rtol=1e-4, atol=1e-4)


def test_per_slot_form_when_switched_off():
    hook, out = _hook(3)
    x, y = torch.randn(4, 256), torch.randn(4, out)
    rows = LoraRows.of(torch.tensor([0, 1, 1, -1]))
    LoraHook.dense = False
    try:
        got = hook.apply(y.clone(), x, rows)
    finally:
        LoraHook.dense = True
    assert torch.equal(got, _per_slot(hook, y, x, rows))
