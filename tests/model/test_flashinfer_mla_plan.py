"""FlashInfer's MLA decode plan (``attention/mla_plan.py``) on CPU, against a hand-made batch:
ragged lengths, partial last pages, padded tables, the latent pool split into ckv and kpe views,
and the plan read back the way FlashInfer reads it giving the torch twin's attention. A tiny
DeepSeek runs its layers' FlashInfer wiring over a host stand-in for the wrapper; one test runs
FlashInfer itself against the twin where CUDA and flashinfer are present."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from support.deepseek_util import make_deepseek_checkpoint
from support.model_util import greedy_generate

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.attention.mla_plan import (
    flashinfer_mla_fits,
    mla_decode_plan,
    split_latent,
    use_flashinfer_mla,
)
from pdserve.engine.model_executor.layers.mla_attention import MLAShape, MLAStep
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.kernels.mla_decode import mla_decode_torch

PAGE = 4

# four decode rows over a 10-page pool (page 0 the scratch page that pads the table):
# 1 token (one partial page), 4 (one full page), 5 (a full page and one token), 11 (two full, 3 of 4)
TABLE = torch.tensor([
    [7, 0, 0],
    [3, 0, 0],
    [2, 9, 0],
    [5, 1, 8],
], dtype=torch.int32)
LENS = [1, 4, 5, 11]


def test_plan_arrays_of_a_ragged_batch():
    plan = mla_decode_plan(TABLE, LENS, PAGE)
    assert plan.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    # pages per row: 1, 1, 2, 3; padding past a row's last used page is not listed
    assert plan.kv_indptr.tolist() == [0, 1, 2, 4, 7]
    assert plan.kv_indices.tolist() == [7, 3, 2, 9, 5, 1, 8]
    assert plan.kv_len_arr.tolist() == LENS
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_len_arr):
        assert t.dtype == torch.int32 and t.device.type == "cpu"


def test_plan_takes_a_strided_table_and_rows_that_share_pages():
    """MLAStep's table is a column slice of the batch's; the absorbed prefill gives one row per new
    token of a sequence, all over the same pages with growing lengths."""
    wide = torch.tensor([[4, 6, 0, 0, 0], [4, 6, 0, 0, 0], [4, 6, 0, 0, 0]], dtype=torch.int64)
    plan = mla_decode_plan(wide[:, :2], [4, 5, 6], PAGE)
    assert plan.kv_indptr.tolist() == [0, 1, 3, 5]
    assert plan.kv_indices.tolist() == [4, 4, 6, 4, 6]
    assert plan.kv_len_arr.tolist() == [4, 5, 6]


def test_plan_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match="one row per length"):
        mla_decode_plan(TABLE, LENS[:3], PAGE)
    with pytest.raises(ValueError, match="more than the table's 3 pages"):
        mla_decode_plan(TABLE, [1, 4, 5, 13], PAGE)
    with pytest.raises(ValueError, match="at least its own token"):
        mla_decode_plan(TABLE, [0, 4, 5, 11], PAGE)
    empty = mla_decode_plan(torch.zeros(0, 3, dtype=torch.int32), [], PAGE)
    assert empty.kv_indptr.tolist() == [0] and empty.kv_indices.numel() == 0


def test_split_latent_is_two_views_of_the_pool():
    r, dr = 8, 4
    cache = torch.randn(1, 10, PAGE, r + dr)
    ckv, kpe = split_latent(cache, r)
    assert ckv.shape == (10, PAGE, r) and kpe.shape == (10, PAGE, dr)
    assert ckv.stride() == (PAGE * (r + dr), r + dr, 1) and kpe.stride() == ckv.stride()
    assert ckv.data_ptr() == cache.data_ptr()
    assert kpe.data_ptr() == cache.data_ptr() + r * cache.element_size()
    assert torch.equal(ckv[5, 2], cache[0, 5, 2, :r]) and torch.equal(kpe[5, 2], cache[0, 5, 2, r:])
    cache[0, 3, 1] = 7.0  # a layer's store is what the views read
    assert (ckv[3, 1] == 7.0).all() and (kpe[3, 1] == 7.0).all()
    with pytest.raises(ValueError, match="must split"):
        split_latent(cache, r + dr)
    with pytest.raises(ValueError, match=r"\[1, pages, page_size, width\]"):
        split_latent(cache[0], r)


def read_as_flashinfer(q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, plan, scale: float) -> torch.Tensor:
    """FlashInfer's MLA decode as its documentation states it, one request at a time: request i's
    tokens are the first kv_len_arr[i] of its listed pages; scores are q_nope . ckv + q_pe . kpe."""
    r = ckv.shape[-1]
    out = []
    for i in range(len(plan.kv_len_arr)):
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]].long()
        n_tok = int(plan.kv_len_arr[i])
        c = ckv[pages].reshape(-1, r)[:n_tok]  # [L, r]
        k = kpe[pages].reshape(-1, kpe.shape[-1])[:n_tok]  # [L, dr]
        s = (q[i, :, :r] @ c.T + q[i, :, r:] @ k.T) * scale  # [H, L]
        out.append(torch.softmax(s, dim=-1) @ c)
    return torch.stack(out)


def test_plan_and_views_carry_the_twins_attention():
    """Read through the plan and the split views, the pool gives mla_decode_torch's output: the
    arrays hold every page and length the twin uses, and nothing past a row's length."""
    gen = torch.Generator().manual_seed(0)
    r, dr, heads = 16, 8, 3
    cache = torch.randn(1, 10, PAGE, r + dr, generator=gen, dtype=torch.float64)
    q = torch.randn(len(LENS), heads, r + dr, generator=gen, dtype=torch.float64)
    scale = (r + dr) ** -0.5
    ckv, kpe = split_latent(cache, r)
    got = read_as_flashinfer(q, ckv, kpe, mla_decode_plan(TABLE, LENS, PAGE), scale)
    want = mla_decode_torch(q, cache, TABLE, torch.tensor(LENS, dtype=torch.int32), r, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the twin's softmax is float32
    # one token fewer for the last row (its partial page read one short) is far outside that
    short = mla_decode_plan(TABLE, [*LENS[:3], LENS[3] - 1], PAGE)
    assert (read_as_flashinfer(q, ckv, kpe, short, scale)[3] - want[3]).abs().max() > 1e-3


def step_batch(device: str = "cpu") -> ForwardBatch:
    """A mixed step: three decode rows (lengths 5, 1, 11) and a 3-token prefill of a new sequence."""
    table = torch.tensor([[2, 9, 0], [7, 0, 0], [5, 1, 8], [4, 0, 0]], dtype=torch.int32)
    extend = [1, 1, 1, 3]
    n = sum(extend)
    return ForwardBatch(input_ids=torch.zeros(n, dtype=torch.int64, device=device),
                        positions=torch.zeros(n, dtype=torch.int64, device=device),
                        out_cache_loc=torch.zeros(n, dtype=torch.int64, device=device),
                        page_table=table.to(device), logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
                        extend_lens=extend, seq_lens=[5, 1, 11, 3])


def test_mla_step_plans_exactly_its_decode_rows():
    meta = MLAStep(step_batch(), PAGE)
    assert meta.dec_rows.tolist() == [0, 1, 2] and not meta.all_decode
    plan = mla_decode_plan(meta.dec_pages, meta.dec_lens_host, meta.page_size)
    assert plan.kv_indptr.tolist() == [0, 2, 3, 6]
    assert plan.kv_indices.tolist() == [2, 9, 7, 5, 1, 8]
    assert plan.kv_len_arr.tolist() == [5, 1, 11]


def test_cpu_never_selects_or_imports_flashinfer():
    assert flashinfer_mla_fits(512, 64, torch.bfloat16) and flashinfer_mla_fits(512, 64, torch.float16)
    assert not flashinfer_mla_fits(512, 64, torch.float32)
    assert not flashinfer_mla_fits(32, 8, torch.bfloat16)
    assert not use_flashinfer_mla(torch.device("cpu"), 512, 64, torch.bfloat16)
    assert not use_flashinfer_mla(torch.device("cuda"), 32, 8, torch.bfloat16)  # a tiny model's latent
    MLAStep(step_batch(), PAGE)
    assert "flashinfer" not in sys.modules


HAS_FLASHINFER_CUDA = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(not HAS_FLASHINFER_CUDA, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_mla_matches_the_torch_twin(page_size):
    """FlashInfer's MLA decode, planned by MLAStep as a layer asks for it, against the twin in
    float32 over the same bf16 pool: ragged lengths with partial last pages, DeepSeek's widths."""
    from pdserve.engine.model_executor.attention.flashinfer_backend import FlashInferMLADecode

    device = torch.device("cuda")
    r, dr, heads = 512, 64, 16
    lens = [1, 7, page_size * 3 + 1, 300]
    widths = [-(-n // page_size) for n in lens]
    gen = torch.Generator().manual_seed(0)
    num_pages = 1 + sum(widths)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    at = 0
    for i, w in enumerate(widths):
        table[i, :w] = torch.tensor(perm[at : at + w])
        at += w
    cache = torch.randn(1, num_pages, page_size, r + dr, generator=gen).to(torch.bfloat16).to(device)
    q = torch.randn(len(lens), heads, r + dr, generator=gen).to(torch.bfloat16).to(device)
    scale = (128 + dr) ** -0.5
    batch = ForwardBatch(input_ids=torch.zeros(len(lens), dtype=torch.int64, device=device),
                         positions=torch.zeros(len(lens), dtype=torch.int64, device=device),
                         out_cache_loc=torch.zeros(len(lens), dtype=torch.int64, device=device),
                         page_table=table.to(device), logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
                         extend_lens=[1] * len(lens), seq_lens=lens)
    meta = MLAStep(batch, page_size)
    shape = MLAShape(hidden=1024, num_heads=heads, q_lora_rank=None, kv_lora_rank=r, qk_nope_head_dim=128,
                     qk_rope_head_dim=dr, v_head_dim=128, rms_norm_eps=1e-6)
    fi = meta.flashinfer_decode(heads, shape, scale, q.dtype, cache)
    assert isinstance(fi, FlashInferMLADecode)
    assert meta.flashinfer_decode(heads, shape, scale, q.dtype, cache) is fi  # one plan per step
    got = fi(q, cache)
    want = mla_decode_torch(q.float(), cache.float(), meta.dec_pages, meta.dec_lens, r, scale)
    assert got.shape == (len(lens), heads, r) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)


class FakeMLAWrapper:
    """BatchMLAPagedAttentionWrapper's documented plan/run, in torch on the host: how the layers'
    wiring is checked where no GPU is (argument order, one plan per step, the views it is given)."""

    plans: list[dict] = []
    runs = 0

    def __init__(self, float_workspace_buffer, backend="auto"):
        self.workspace = float_workspace_buffer

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        self.args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr,
                         num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                         page_size=page_size, causal=causal, sm_scale=sm_scale)
        FakeMLAWrapper.plans.append(self.args)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, return_lse=False):
        a = self.args
        n = len(a["kv_len_arr"])
        assert q_nope.shape == (n, a["num_heads"], a["head_dim_ckv"]) and q_pe.shape[2] == a["head_dim_kpe"]
        assert ckv_cache.shape[1:] == (a["page_size"], a["head_dim_ckv"]) and kpe_cache.shape[2] == a["head_dim_kpe"]
        assert a["qo_indptr"].tolist() == list(range(n + 1)) and not return_lse
        FakeMLAWrapper.runs += 1
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = read_as_flashinfer(q.double(), ckv_cache.double(), kpe_cache.double(), PlanView(a), a["sm_scale"])
        return out.to(q_nope.dtype)


class PlanView:
    def __init__(self, args: dict):
        self.kv_indptr, self.kv_indices, self.kv_len_arr = args["kv_indptr"], args["kv_indices"], args["kv_len_arr"]


def test_layers_run_flashinfer_wiring_like_the_twin(monkeypatch, tmp_path):
    """A tiny DeepSeek-V3 with every MLA layer switched to the FlashInfer path over a host stand-in
    for the wrapper: the same logits as the twin on every step (a mixed first step, then decode),
    one plan per step, every layer running it."""
    fake = types.ModuleType("flashinfer")
    fake.mla = types.ModuleType("flashinfer.mla")
    fake.mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fake.mla)
    monkeypatch.setattr(FakeMLAWrapper, "plans", [])
    monkeypatch.setattr(FakeMLAWrapper, "runs", 0)

    make_deepseek_checkpoint("v3", str(tmp_path))
    runner = ModelRunner(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024, page_size=4))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 23, 1)]
    steps = 5
    want_tokens, want = greedy_generate(runner, prompts, steps)
    layers = [layer.self_attn for layer in runner.model.model.layers]
    for attn in layers:
        attn.flashinfer = True
    got_tokens, got = greedy_generate(runner, prompts, steps, forced=want_tokens)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert got_tokens == want_tokens
    assert len(FakeMLAWrapper.plans) == steps  # the first step's one decode row, then every step's three
    assert FakeMLAWrapper.runs == steps * len(layers)
    first, last = FakeMLAWrapper.plans[0], FakeMLAWrapper.plans[-1]
    assert first["kv_len_arr"].tolist() == [1]
    assert last["kv_len_arr"].tolist() == [7 + steps - 1, 23 + steps - 1, 1 + steps - 1]
    assert first["page_size"] == 4 and first["sm_scale"] == layers[0].scale and first["causal"] is False
    runner.page_pool.check_integrity()
