"""The token embedding (replicated) and the LM head (split by vocabulary).

The embedding lookup is a gather of T rows, so sharding it would only add an all-reduce; the
LM head's product is a large share of a small model's decode step, so each rank multiplies its
``ceil(vocab / tp)`` rows (the last rank's padded with zeros) and the logits are all-gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear import LinearBase
from pdserve.engine.model_executor.layers.linear_method import linear_method
from pdserve.engine.model_executor.parallel import HeadShard, all_gather_last_dim


class VocabEmbedding:
    """weight [vocab, hidden] in the model dtype, on every rank."""

    def __init__(self, plan: KernelPlan, vocab: int, hidden: int):
        self.weight = torch.empty(vocab, hidden, dtype=plan.dtype, device=plan.device)

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        self.weight.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T, hidden]


class ParallelLMHead(LinearBase):
    """This rank's ``vocab_shard`` rows of the head; ``forward`` returns every rank's logits,
    float32 [M, vocab]. ``tie``: the embedding's rows are the head's (no copy where the method
    keeps the plain tensor)."""

    def __init__(self, plan: KernelPlan, vocab: int, hidden: int, tp: HeadShard):
        self.vocab = vocab
        self.vocab_shard = -(-vocab // tp.size)
        self.rank = tp.rank
        rows = slice(tp.rank * self.vocab_shard, (tp.rank + 1) * self.vocab_shard)
        n = len(range(vocab)[rows])
        super().__init__(plan, n, hidden, {None: (slice(0, n), rows, slice(None))},
                         method=linear_method(plan, head=True))

    def tie(self, embedding: VocabEmbedding) -> None:
        """Read the head's rows from the (loaded) embedding's storage."""
        self.weight = embedding.weight[self.parts[None][1]]
        self._loaded.add(("weight", None))
        self.process_weights()

    def process_weights(self, pad_rows: int | None = None) -> None:
        super().process_weights(self.vocab_shard)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [M, hidden] (the sampled rows) -> float32 [M, vocab], identical on every rank."""
        return self.gather(self.method.apply_logits(x, step))

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's [M, vocab_shard] logits -> float32 [M, vocab], every rank's columns."""
        logits = all_gather_last_dim(logits.float())
        return logits[:, : self.vocab] if logits.shape[1] != self.vocab else logits

    def read_back(self, param: str = "weight", shard_id: str | None = None) -> torch.Tensor:
        head = self.method.dense()
        return head[: min(head.shape[0], self.vocab - self.rank * self.vocab_shard)]
