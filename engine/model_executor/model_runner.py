"""ModelRunner: owns the model replica, its tokenizer and its KV page pool, and runs one step.

The scheduler side builds a ForwardBatch (pages allocated from ``page_pool``)
and calls ``forward``; it gets float32 logits for the rows it asked for.

Under tensor parallelism (this process in a TP group, see ``parallel``) the runner holds
its rank's shard of the model and a page pool of its KV heads only; every rank has the
same number of pages (the smallest any rank could afford), so identical scheduling on
every rank means identical page allocations, and ``forward`` returns the full logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

import pdserve.engine.env as env
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.model_loader import load_model
from pdserve.engine.model_executor.models.llama import LlamaForCausalLM, can_prepack
from pdserve.engine.model_executor.parallel import all_reduce_min, head_shard, tp_rank, tp_size
from pdserve.engine.sched.page_pool import PagePool
from pdserve.engine.model_executor.tokenizer import load_tokenizer_from_source
from pdserve.kernels.attention_backend import create_attention_backend

logger = logging.getLogger(__name__)


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 matmul (AVX-512 BF16 or AMX), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA or a bf16-capable CPU, else float32."""
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float32":
        return torch.float32
    if name != "auto":
        raise ValueError(f"dtype must be auto, bfloat16 or float32, got {name!r}")
    if device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16()):
        return torch.bfloat16
    return torch.float32


def available_memory_bytes(device: torch.device) -> int:
    """Free memory the KV pool may draw a fraction of: MemAvailable on CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def pool_num_pages(config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                   num_kv_heads: int | None = None) -> int:
    """Pages for ``max_total_tokens``, else for ``mem_fraction`` of free memory, capped at what
    ``max_running_requests`` full-context sequences could ever hold. ``num_kv_heads``: the heads
    this pool holds (a TP rank's share; default all of the model's)."""
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    else:
        kv_heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
        per_token = PagePool.bytes_per_token(arch.num_layers, kv_heads, arch.head_dim, dtype)
        tokens = int(available_memory_bytes(device) * config.mem_fraction) // per_token
        tokens = min(tokens, config.max_running_requests * arch.max_context_len)
    num_pages = tokens // config.page_size + 1  # + the reserved scratch page 0
    if num_pages < 2:
        raise ValueError(f"max_total_tokens too small for one page of {config.page_size} tokens")
    return num_pages


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        threads = config.num_threads or env.PDSERVE_NUM_THREADS
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        t0 = time.perf_counter()
        arch, weights, source = load_model(config.model_path)
        self.arch: ModelArch = arch
        self.model_source = source
        arch.check_tp_size(tp_size())
        self.tp = tp = head_shard(tp_rank(), tp_size(), arch.num_heads, arch.num_kv_heads)
        prepack = can_prepack(self.dtype, self.device, cpu_supports_bf16())
        self.model = LlamaForCausalLM(arch, weights, self.dtype, self.device, prepack=prepack, tp=tp,
                                      quantization=config.quantization, gemv=not config.disable_decode_gemv)
        del weights
        self.tokenizer = load_tokenizer_from_source(source)
        num_pages = all_reduce_min(pool_num_pages(config, arch, self.dtype, self.device, tp.num_kv_heads))
        self.page_pool = PagePool(num_pages, config.page_size, arch.num_layers, tp.num_kv_heads,
                                  arch.head_dim, self.dtype, self.device, config.quantization)
        self.attn_backend = create_attention_backend(
            config.attention_backend, self.page_pool, tp.num_heads, tp.num_kv_heads, arch.head_dim,
            arch.head_dim ** -0.5,
        )
        logger.info("loaded %s (%s) as %s, weights %s, in %.1fs (TP rank %d of %d: %d heads, %d KV heads); "
                    "decode steps of <= %d tokens through native gemv; KV pool %d pages of %d tokens", source.path,
                    arch.arch, self.dtype, config.quantization, time.perf_counter() - t0, tp.rank, tp.size,
                    tp.num_heads, tp.num_kv_heads, self.model.gemv_rows, num_pages - 1, config.page_size)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab]. ``after_layer(i)``
        runs once layer i stored its KV (layer-wise KV send, ``kvtransfer/layer_signal.py``)."""
        batch = self._to_device(batch)
        self.attn_backend.begin_forward(batch)
        return self.model.forward(batch, self.attn_backend, after_layer)

    def _to_device(self, batch: ForwardBatch) -> ForwardBatch:
        if batch.input_ids.device == self.device and batch.out_cache_loc.dtype == torch.int64:
            return batch
        dev = self.device
        return ForwardBatch(
            input_ids=batch.input_ids.to(dev, torch.int64),
            positions=batch.positions.to(dev, torch.int64),
            out_cache_loc=batch.out_cache_loc.to(dev, torch.int64),
            page_table=batch.page_table.to(dev),
            logits_indices=batch.logits_indices.to(dev, torch.int64),
            extend_lens=batch.extend_lens,
            seq_lens=batch.seq_lens,
        )
