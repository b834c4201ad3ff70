"""The ``deepep`` exchange: DeepEP's dispatch and combine kernels (CUDA, NVLink/RDMA), written
against DeepEP's documented ``deep_ep.Buffer`` API. Not run on the CPU machines this project
tests on (no DeepEP build there); the gloo exchange is the one the tests cover.

Two modes, chosen per step as SGLang's ``auto`` does: prefill steps use the normal kernels
(``get_dispatch_layout`` + ``dispatch``/``combine``: variable rows per rank, each received row
with its top-k ids already local to this rank, -1 for slots of other ranks), decode steps the
low-latency kernels (``low_latency_dispatch``/``low_latency_combine``: a fixed
``max_dispatch_tokens_per_rank`` per rank, rows packed per local expert, weights applied by the
combine). DeepEP places experts contiguously (rank r holds ``[r E/n, (r+1) E/n)``), the
placement ``FusedMoE`` uses by default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.engine.model_executor.layers.ep_placement import ExpertPlacement
from pdserve.engine.model_executor.layers.kernel_plan import Step
from pdserve.engine.model_executor.layers.moe_a2a import ExchangeStats, Experts

# decode steps of up to this many tokens per rank go through the low-latency kernels
MAX_DISPATCH_TOKENS_PER_RANK = 128
NVL_BUFFER_BYTES = 1 << 30
LOW_LATENCY_RDMA_BYTES_CAP = 1 << 31


class DeepEPExchange:
    def __init__(self, placement: ExpertPlacement, rank: int, hidden: int, dtype: torch.dtype):
        try:
            from deep_ep import Buffer
        except ImportError as e:
            raise RuntimeError("moe_a2a_backend 'deepep' needs the deep_ep package (DeepEP, built for CUDA)") from e
        if not placement.is_identity:
            raise ValueError("moe_a2a_backend 'deepep' needs the contiguous expert placement (no redundant experts, "
                             "no --init-expert-location, no EPLB)")
        self.num_experts, self.rank, self.hidden = placement.num_physical, rank, hidden
        self.group = dist.group.WORLD
        size = dist.get_world_size()
        rdma = Buffer.get_low_latency_rdma_size_hint(MAX_DISPATCH_TOKENS_PER_RANK, hidden, size, self.num_experts)
        self.buffer = Buffer(self.group, num_nvl_bytes=NVL_BUFFER_BYTES,
                             num_rdma_bytes=min(rdma, LOW_LATENCY_RDMA_BYTES_CAP), low_latency_mode=True,
                             num_qps_per_rank=max(1, self.num_experts // size))
        self.stats = ExchangeStats()

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
            experts: Experts) -> torch.Tensor:
        """Every rank's own tokens in and out (DP attention), or, with TP attention, the same tokens
        on every rank: then each rank's combine returns the full sum for all of them."""
        if step.decode and x.shape[0] <= MAX_DISPATCH_TOKENS_PER_RANK:
            return self._low_latency(x, topk_weights, topk_ids, step, experts)
        return self._normal(x, topk_weights, topk_ids, step, experts)

    def _normal(self, x, topk_weights, topk_ids, step, experts):
        ids = topk_ids.to(torch.int64)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_weights, _, handle, _ = self.buffer.dispatch(
            x, topk_idx=ids, topk_weights=topk_weights.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y = experts(recv_x, recv_weights, recv_ids, Step(recv_x.shape[0], step.decode))  # ids local, -1 elsewhere
        combined, _, _ = self.buffer.combine(y, handle)
        self.stats.calls += 1
        self.stats.bytes_sent += (x.numel() + y.numel()) * x.element_size()
        return combined

    def _low_latency(self, x, topk_weights, topk_ids, step, experts):
        ids = topk_ids.to(torch.int64)
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            x, ids, MAX_DISPATCH_TOKENS_PER_RANK, self.num_experts, use_fp8=False)
        # recv_x [local experts, max tokens * ranks, H]; expert e's first recv_count[e] rows are its tokens
        out = torch.zeros_like(recv_x)
        for e, n in enumerate(recv_count.tolist()):
            if n:
                rows = recv_x[e, :n]
                ones = torch.ones(n, 1, dtype=torch.float32, device=x.device)
                local = torch.full((n, 1), e, dtype=torch.int64, device=x.device)
                out[e, :n] = experts(rows, ones, local, Step(n, step.decode))  # the combine weighs them
        combined, _, _ = self.buffer.low_latency_combine(out, ids, topk_weights.float(), handle)
        self.stats.calls += 1
        self.stats.bytes_sent += (x.numel() + out.numel()) * x.element_size()
        return combined
