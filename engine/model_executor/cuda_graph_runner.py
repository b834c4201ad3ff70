"""Decode steps replayed from graphs captured once per batch-size bucket (SGLang's CudaGraphRunner).

On CUDA a decode step of a small model is mostly kernel launches from Python; a graph captured
at start-up replays the whole step as one launch. A graph fixes every shape and address, so:

- the step's inputs live in static buffers sized for ``max_bs`` sequences of ``max_pages``
  pages, and a replay copies the batch into them;
- a batch of ``bs`` sequences runs the graph of the smallest bucket >= bs (``decode_buckets``);
  the padding rows are token 0 at position 0, writing their K/V to slot 0 and attending to it
  alone: slot 0 is in page 0, the pool's scratch page, which no sequence owns, so padding
  changes no real row's inputs, KV or attention (only a product's row count, as any batch size
  does);
- the attention backend keeps its per-step metadata in buffers of its own as well
  (``AttentionBackend.init_graph_state`` / ``begin_graph_forward``), refilled before each replay,
  outside the graph (FlashInfer plans on the host).

The capture is a function (``Capture``): ``cuda_graph_capture`` records a CUDA graph;
``eager_capture`` replays nothing and runs the step again on the static buffers. The second is
how this module's padding and metadata are tested where no GPU is (tests/model/test_cuda_graph_runner.py):
everything here runs the same but the recording.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from pdserve.engine.model_executor.models.base import CausalLM
    from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend

Step = Callable[[], torch.Tensor]
# records ``step`` (run on the static buffers) and returns what replays it: the replay returns
# the step's output tensor, overwritten in place by each replay
Capture = Callable[[Step], Step]


def decode_buckets(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every 8 up to ``max_bs``, and ``max_bs`` itself
    (SGLang's default list, cut at max_bs)."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = {b for b in (1, 2, 4) if b < max_bs} | set(range(8, max_bs, 8)) | {max_bs}
    return sorted(sizes)


def bucket_for(bs: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``bs`` sequences; ValueError past the largest."""
    i = bisect.bisect_left(buckets, bs)
    if bs < 1 or i == len(buckets):
        raise ValueError(f"batch size {bs} outside the captured buckets 1..{buckets[-1]}")
    return buckets[i]


def eager_capture(step: Step) -> Step:
    """No recording: a replay runs ``step`` again (the padding and metadata of a graph, tested on CPU)."""
    return step


def cuda_graph_capture(device: torch.device) -> Capture:
    """Record each step as a CUDA graph, all graphs in one memory pool (SGLang captures likewise;
    a replay's output may share memory with another graph's, so it is read before the next replay)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)

    def capture(step: Step) -> Step:
        # warm up outside the graph on the capture stream: lazy initialisation, library handles
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphRunner:
    """Decode steps of up to ``max_bs`` sequences of up to ``max_pages`` pages each, replayed from
    ``capture``'s recordings of ``model``'s forward, one per bucket, taken here (largest first)."""

    def __init__(self, model: CausalLM, attn: AttentionBackend, max_bs: int, max_pages: int,
                 capture: Capture):
        self.model, self.attn = model, attn
        self.buckets = decode_buckets(max_bs)
        device = attn.page_pool.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)  # slot 0: scratch page 0
        self.page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_bs, device=device)
        attn.init_graph_state(max_bs, max_pages)
        self.replays: Counter[int] = Counter()  # bucket -> replays
        t0 = time.perf_counter()
        self.graphs: dict[int, Step] = {}
        with torch.inference_mode():
            for bs in reversed(self.buckets):
                self._begin(bs, [1] * bs)
                self.graphs[bs] = capture(self._step(bs))
        self.capture_s = time.perf_counter() - t0

    def can_run(self, batch: ForwardBatch) -> bool:
        """An all-decode step the static buffers hold."""
        return (batch.is_decode and 1 <= batch.batch_size <= self.buckets[-1]
                and batch.page_table.shape[1] <= self.page_table.shape[1] and batch.logits_indices.numel() > 0)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """``model.forward(batch)`` through the bucket's graph: float32 logits of the rows
        ``batch.logits_indices`` selects (a copy: the next replay overwrites the graph's)."""
        bs = batch.batch_size
        padded = bucket_for(bs, self.buckets)
        width = batch.page_table.shape[1]
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        # entries past a row's pages may be stale: every backend stops at the row's length
        self.page_table[:bs, :width].copy_(batch.page_table)
        self.seq_lens[:bs].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        if padded > bs:  # padding rows: token 0 at position 0 into scratch slot 0, one key (itself)
            for buf in (self.input_ids, self.positions, self.out_cache_loc, self.page_table[:, 0]):
                buf[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
        self._begin(padded, list(batch.seq_lens) + [1] * (padded - bs))
        logits = self.graphs[padded]()
        self.replays[padded] += 1
        return logits.index_select(0, batch.logits_indices.to(logits.device))

    def _begin(self, bs: int, seq_lens: list[int]) -> None:
        self.attn.begin_graph_forward(bs, self.page_table[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs],
                                      seq_lens)

    def _step(self, bs: int) -> Step:
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            page_table=self.page_table[:bs],
            logits_indices=self.rows[:bs],
            extend_lens=[1] * bs,
            seq_lens=[1] * bs,  # unused by the model: attention reads the backend's graph metadata
        )
        model, attn = self.model, self.attn
        return lambda: model.forward(batch, attn)
