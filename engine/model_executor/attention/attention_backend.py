"""The attention backend interface and its registry.

A backend does two things per layer: write the step's new K/V into the page
pool, and attend each new token over its sequence's cached tokens. Per-step
metadata (gather indices, masks) is built once in ``begin_forward`` and reused
by all layers, which keeps per-layer Python work small.

``ATTENTION_BACKENDS`` names each backend: the names are the choices of
``--attention-backend`` and what ``EngineConfig`` accepts, so a typo fails at
the command line. This module imports no torch (only for type checking): the
config and the CLI read the names without loading any backend. Adding a
backend: an ``AttentionBackend`` subclass in its own module and one line here.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.engine.mem_cache.forward_batch import ForwardBatch
    from pdserve.engine.mem_cache.page_pool import PagePool


class AttentionBackend(ABC):
    def __init__(self, page_pool: PagePool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        """Attend over ``page_pool``'s pages for a model of these head counts; ``scale`` multiplies
        the scores (usually ``head_dim ** -0.5``). Raise ValueError where the device does not fit."""
        self.page_pool = page_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def begin_forward(self, batch: ForwardBatch) -> None:
        """Prepare the step's metadata from ``batch`` (tensors already on the pool's device)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Store ``k``/``v`` at the step's ``out_cache_loc`` in ``layer``'s pages, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (views may be strided).
        Returns [num_tokens, num_heads * head_dim], causal over each sequence's prefix and new tokens.
        """

    def native_decode_pages(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where every row of this step is one sequence's next token and this backend attends them
        with ``cpu_native``'s decode attention: its (page_table [n, P] int32 contiguous, seq_lens [n]
        int32), so that a fused native decode step may store K/V and attend exactly as ``forward``
        would. None otherwise (the default: ``forward`` for every layer)."""
        return None

    # ------------------------------------------------- graphs (engine/model_executor/cuda_graph_runner.py)
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        """Allocate the metadata buffers of all-decode steps of up to ``max_bs`` sequences of up to
        ``max_pages`` pages, for steps replayed from captured graphs. Default: graphs unsupported."""
        raise NotImplementedError(f"{type(self).__name__} does not support decode graphs")

    def begin_graph_forward(self, bs: int, page_table: torch.Tensor, seq_lens: torch.Tensor,
                            out_cache_loc: torch.Tensor, host_seq_lens: list[int]) -> None:
        """``begin_forward`` of an all-decode step of ``bs`` sequences whose inputs are the graph
        runner's static buffers (page_table [bs, max_pages] int32, seq_lens [bs] int32,
        out_cache_loc [bs] int64; ``host_seq_lens`` the same lengths on the host): fill this
        backend's graph buffers in place, so that a graph captured after this call reads the next
        step's metadata when it is called again before a replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support decode graphs")


# name -> "module:Class"; a backend's module is imported only when it is chosen
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "pdserve.engine.model_executor.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "pdserve.engine.model_executor.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def attention_backend_names() -> list[str]:
    """The choices of ``--attention-backend``."""
    return list(ATTENTION_BACKENDS)


def check_attention_backend(name: str) -> None:
    """ValueError naming the choices unless ``name`` is registered."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {attention_backend_names()}, got {name!r}")


def create_attention_backend(name: str, page_pool: PagePool, num_heads: int, num_kv_heads: int,
                             head_dim: int, scale: float) -> AttentionBackend:
    """Import the backend registered as ``name`` and build it."""
    check_attention_backend(name)
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(page_pool, num_heads, num_kv_heads, head_dim, scale)
