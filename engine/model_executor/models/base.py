"""CausalLM: what every model offers the model runner, and what it declares to be loaded."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.loader import load_weights
from pdserve.engine.model_executor.layers.vocab import ParallelLMHead
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.parallel import HeadShard
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend


class CausalLM(ABC):
    """A model: layers named as the checkpoint names its tensors, plus the map of merged and
    tied tensors (``layers/loader.py``)."""

    #: checkpoint part -> (merged layer, shard id): "q_proj" -> ("qkv_proj", "q")
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {}
    #: a tensor a checkpoint may omit -> the one it shares
    tied_weights: ClassVar[dict[str, str]] = {}
    #: the model runs under data-parallel attention (``dp_attention.py``): it has ``idle_forward``
    dp_attention: ClassVar[bool] = False
    #: set by a proposer drafting from the hidden states (NEXTN): each step's final-normed rows are
    #: kept in ``last_hidden`` (a model that supports it; captured graphs keep none)
    keep_hidden: bool = False

    def __init__(self, arch: ModelArch, plan: KernelPlan, tp: HeadShard):
        self.arch, self.plan, self.tp = arch, plan, tp

    def expert_weight_name(self, name: str) -> tuple[str, str, int] | None:
        """(the expert layer's tensor name, shard id, expert id) of an expert's checkpoint tensor,
        or None (no experts here: ``moe.expert_weight_name`` maps the usual names)."""
        return None

    def load_weights(self, weights: dict[str, torch.Tensor],
                     q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        load_weights(self, weights, q8_0)

    def idle_forward(self) -> None:
        """Under DP attention, a forward of no rows that joins the other groups' collectives."""
        raise NotImplementedError(f"{type(self).__name__} does not run under DP attention")

    def no_logits(self) -> torch.Tensor:
        """The logits of a step that samples no row (a middle chunk of a chunked prefill): [0, vocab]."""
        return torch.empty(0, self.arch.vocab_size, dtype=torch.float32, device=self.plan.device)

    def sampled_logits(self, h: torch.Tensor, batch: ForwardBatch, norm: Any, lm_head: ParallelLMHead) -> torch.Tensor:
        """The LM head over the sampled rows (``batch.logits_indices``) of the last layer's h
        [T, hidden], normed by ``norm`` (None: h is normed already): float32 [num_sampled, vocab]."""
        if batch.logits_indices.numel() == 0:
            return self.no_logits()
        h = h.index_select(0, batch.logits_indices)  # [num_sampled, hidden]
        return lm_head.forward(h if norm is None else norm.forward(h), Step(h.shape[0], batch.is_decode))

    @abstractmethod
    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; ``attn.begin_forward(batch)`` already ran.
        ``after_layer(i)``: called once layer i's attention stored its K and V (layer-wise KV send)."""
