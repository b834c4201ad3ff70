"""ModelRunner: owns the model replica, its tokenizer and its KV page pool, and runs one step.

The scheduler side builds a ForwardBatch (pages allocated from ``page_pool``)
and calls ``forward``; it gets float32 logits for the rows it asked for.

Under tensor parallelism (this process in a TP group, see ``parallel``) the runner holds
its rank's shard of the model and a page pool of its KV heads only; every rank has the
same number of pages (the smallest any rank could afford), so identical scheduling on
every rank means identical page allocations, and ``forward`` returns the full logits.

On CUDA, all-decode steps replay graphs captured per batch-size bucket at start-up
(``cuda_graph_runner``; ``--cuda-graph-max-bs``, ``--disable-cuda-graph``), verify steps among
them (a bucket counts rows: a verify step feeds each sequence its drafts as decode rows).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

import pdserve.engine.env as env
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor import dp_attention
from pdserve.engine.model_executor.cuda_graph_runner import DecodeGraphRunner, cuda_graph_capture
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.host_memory import host_memory_bytes, trim_heap
from pdserve.engine.model_executor.eplb import ExpertBalancer
from pdserve.engine.model_executor.expert_location import expert_locations
from pdserve.engine.model_executor.expert_recorder import ExpertRecorder, a2a_families, moe_layers
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.lora_manager import LoraManager
from pdserve.engine.model_executor.model_loader import load_model, read_q8_0_blocks
from pdserve.engine.model_source import ModelSource
from pdserve.engine.model_executor.layers.kernel_plan import can_prepack
from pdserve.engine.model_executor.models.base import CausalLM
from pdserve.engine.model_executor.models.registry import build_model
from pdserve.engine.model_executor.pool_sizing import PoolSize, size_pool, tensor_bytes
from pdserve.engine.model_executor.parallel import all_reduce_min, head_shard, init_ep, tp_rank, tp_size
from pdserve.engine.quantization_names import W8A16
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.engine.model_executor.attention.attention_backend import create_attention_backend
from pdserve.kernels.cpu_native import cpu_flags

logger = logging.getLogger(__name__)


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 matmul (AVX-512 BF16 or AMX), from /proc/cpuinfo."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


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
    """Free device memory (CUDA's own rule of sizing reads it before and after the weights)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def pool_num_pages(config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                   num_kv_heads: int | None = None, free_at_start: int | None = None,
                   weights_bytes: int = 0, ranks: int = 1) -> int:
    """This rank's pool in pages, the reserved scratch page 0 included (``rank_pool_size``'s arguments)."""
    return rank_pool_size(config, arch, dtype, device, num_kv_heads, free_at_start, weights_bytes,
                          ranks).num_pages(config.page_size)


def rank_pool_size(config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                   num_kv_heads: int | None = None, free_at_start: int | None = None,
                   weights_bytes: int = 0, ranks: int = 1, extra_kv_layers: int = 0) -> PoolSize:
    """This rank's pool (``pool_sizing.size_pool``). ``num_kv_heads``: the heads this pool holds (a
    TP rank's share; default all of the model's); ``weights_bytes``: what this rank's weights
    allocated; ``ranks``: the server's scheduler ranks on this host; ``free_at_start``: CUDA's free
    memory before the weights loaded; ``extra_kv_layers``: layers the pool holds past the model's."""
    kv_heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    cuda = device.type == "cuda" and config.max_total_tokens is None
    size = size_pool(
        max_total_tokens=config.max_total_tokens, mem_fraction_static=config.mem_fraction_static,
        device_type=device.type, per_token_bytes=PagePool.bytes_per_token(arch.num_layers + extra_kv_layers, kv_heads,
                                                                             arch.head_dim, dtype, arch.kv_kind),
        weights_bytes=weights_bytes, max_context_len=arch.max_context_len,
        max_running_requests=config.max_running_requests, page_size=config.page_size, ranks=ranks,
        host_bytes=host_memory_bytes() if device.type == "cpu" else None,
        device_free_at_start=free_at_start if cuda else None,
        device_free_now=available_memory_bytes(device) if cuda else None,
    )
    if size.tokens // config.page_size < 1:
        raise ValueError(f"max_total_tokens too small for one page of {config.page_size} tokens")
    return size


class ModelRunner:
    def __init__(self, config: EngineConfig, ranks: int = 1, page_pool: PagePool | None = None,
                 extra_kv_layers: int = 0):
        """``ranks``: the scheduler ranks of this server on this host, which share one memory budget
        on CPU (``pool_sizing``). ``page_pool``: another runner's pool to attend over and write
        into, of this model's KV layout (a self-draft sharing the target's KV), instead of a pool
        of its own. ``extra_kv_layers``: layers its own pool holds past the model's, which the
        model never writes (a PD NEXTN rank's MTP layer, ``nextn_handoff.mtp_kv_layers``)."""
        self.config = config
        threads = config.num_threads or env.PDSERVE_NUM_THREADS
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        t0 = time.perf_counter()
        free_at_start = available_memory_bytes(self.device) if self.device.type == "cuda" else None
        arch, weights, source = load_model(config.model_path)
        if config.context_length is not None:
            arch = arch.with_context_length(config.context_length)
        self.arch: ModelArch = arch
        self.model_source = source
        self.model_path = config.model_path  # what the weights came from (update_weights changes it)
        arch.check_tp_size(tp_size())
        self.tp = tp = head_shard(tp_rank(), tp_size(), arch.num_heads, arch.num_kv_heads)
        if dp_attention.enabled():  # the dense layers split over every attention group
            arch.check_mlp_split(dp_attention.mlp_shard(tp).size)
        self.ep = init_ep(config.ep_size, config.moe_a2a_backend)  # read by every FusedMoE the model builds
        self.model: CausalLM | None = self._build_model(weights, source)
        self.expert_recorder = ExpertRecorder(self.model, arch.num_layers, self.device)
        self.eplb = self._expert_balancer()
        del weights
        # --enable-lora: the adapters of --lora-paths, put into the model's slots on demand
        self.lora = LoraManager(config, self.model, arch.num_layers) if config.enable_lora else None
        self.tokenizer = load_tokenizer(config.model_path, config.tokenizer_path, config.chat_template)
        weights_bytes = tensor_bytes(self.model)
        if page_pool is None:
            size = rank_pool_size(config, arch, self.dtype, self.device, tp.num_kv_heads, free_at_start,
                                  weights_bytes, ranks, extra_kv_layers)
            num_pages = all_reduce_min(size.num_pages(config.page_size))
            self.page_pool = PagePool(num_pages, config.page_size, arch.num_layers + extra_kv_layers, tp.num_kv_heads,
                                      arch.head_dim, self.dtype, self.device, config.quantization, arch.kv_kind)
            self.page_pool.model = self._identity(source)
            rule = size.rule
        else:
            layout = (arch.num_layers, tp.num_kv_heads, arch.head_dim, self.dtype, self.device)
            shared = (page_pool.num_layers, page_pool.num_kv_heads, page_pool.head_dim, page_pool.dtype,
                      page_pool.device)
            if layout != shared:
                raise ValueError(f"a shared page pool must have this model's KV layout (layers, KV heads, head "
                                 f"dim, dtype, device) {layout}, got {shared}")
            self.page_pool, num_pages, rule = page_pool, page_pool.num_pages, "shared with another runner"
        self.attn_backend = create_attention_backend(
            config.attention_backend, self.page_pool, tp.num_heads, tp.num_kv_heads, arch.head_dim,
            arch.head_dim ** -0.5,
        )
        # the KV pages' bytes over the TP ranks of this DP rank (each holds its heads' share)
        self.kv_pool_bytes = self.page_pool.max_total_tokens * tp.size * PagePool.bytes_per_token(
            self.page_pool.num_layers, tp.num_kv_heads, arch.head_dim, self.dtype, arch.kv_kind)
        logger.info("loaded %s (%s) as %s, weights %s (%.2f GiB on this rank), in %.1fs (TP rank %d of %d: %d heads, "
                    "%d KV heads); decode steps of <= %d tokens through native gemv", source.path, arch.arch,
                    self.dtype, config.quantization, weights_bytes / 2**30, time.perf_counter() - t0, tp.rank,
                    tp.size, tp.num_heads, tp.num_kv_heads, self.model.plan.gemv_rows)
        logger.info("KV pool: %d tokens (%d pages of %d), %.2f GiB over %d TP rank(s): %s", self.page_pool.max_total_tokens,
                    num_pages - 1, config.page_size, self.kv_pool_bytes / 2**30, tp.size, rule)
        self.graph_runner: DecodeGraphRunner | None = None
        self._capture_graphs()
        # under DP attention: the kind of round this runner's forwards open, and the idle forward
        # this rank answers each kind of round with (a draft adds its own: ``add_draft``, ``draft_of``)
        self.kind = dp_attention.TARGET
        self.idle_forwards: dict[int, Callable[[], None]] = {dp_attention.TARGET: self._idle_own}

    def _identity(self, source: ModelSource) -> str:
        """The pool's model identity: what the PD pairing check compares (model_identity.py)."""
        from pdserve.engine.model_executor.model_identity import model_identity

        return model_identity(self.arch.arch, source.path, str(self.dtype).removeprefix("torch."),
                              self.config.quantization)

    def _capture_graphs(self) -> None:
        """On CUDA (unless disabled): capture the decode step per batch-size bucket, at start-up
        and again whenever the weights change (a graph holds their addresses)."""
        config = self.config
        self.graph_runner = None
        # a graph would hold one step's LoRA slots: LoRA steps run eagerly
        # nor do DP attention's steps, whose collectives a group's graph cannot agree with the others
        if (self.device.type != "cuda" or config.disable_cuda_graph or config.cuda_graph_max_bs == 0
                or config.enable_lora or dp_attention.enabled()):
            return
        # a verify step is a decode step of 1 + draft tokens rows per sequence (batch_builder)
        rows_per_seq = 1 + config.speculative_num_draft_tokens if config.speculative_algorithm else 1
        max_bs = min(config.cuda_graph_max_bs, config.max_running_requests * rows_per_seq)
        max_pages = -(-self.arch.max_context_len // config.page_size)
        self.graph_runner = DecodeGraphRunner(self.model, self.attn_backend, max_bs, max_pages,
                                              cuda_graph_capture(self.device))
        logger.info("captured CUDA graphs of the decode step for batch sizes %s in %.1fs",
                    self.graph_runner.buckets, self.graph_runner.capture_s)

    def _build_model(self, weights: dict[str, torch.Tensor], source: ModelSource) -> CausalLM:
        prepack = can_prepack(self.dtype, self.device, cpu_supports_bf16())
        # w8a16 keeps a GGUF file's Q8_0 weights as stored rather than quantizing them again
        keep_q8_0 = self.config.quantization == W8A16 and source.format == "gguf"
        q8_0 = read_q8_0_blocks(source.path, self.arch) if keep_q8_0 else None
        model = build_model(self.arch, weights, self.dtype, self.device, prepack=prepack, tp=self.tp,
                            quantization=self.config.quantization, gemv=not self.config.disable_decode_gemv,
                            fused_decode=not self.config.disable_fused_decode,
                            gemm=not self.config.disable_native_gemm, lora=self.config.enable_lora, q8_0=q8_0,
                            before_load=self._place_experts)
        if dp_attention.enabled() and not model.dp_attention:
            raise ValueError(f"enable_dp_attention serves the Llama family, Qwen3-MoE and DeepSeek only, got "
                             f"{type(model).__name__}")
        return model

    def _place_experts(self, model: CausalLM) -> None:
        """Give the MoE layers their starting placement (``--init-expert-location``, with
        ``--ep-num-redundant-experts`` slots) before their weights load."""
        layers = moe_layers(model)
        config = self.config
        if not layers or (config.ep_num_redundant_experts == 0 and config.init_expert_location == "trivial"):
            return
        first = next(iter(layers.values()))
        placements = expert_locations(config.init_expert_location, self.arch.num_layers, sorted(layers),
                                      first.num_experts, config.ep_num_redundant_experts, self.ep.ep_size)
        for i, layer in layers.items():
            layer.set_placement(placements[i])

    def _expert_balancer(self) -> ExpertBalancer | None:
        """``--enable-eplb``: the balancer of this model's MoE layers; None when off or dense."""
        if not self.config.enable_eplb or not self.expert_recorder.has_experts:
            return None
        return ExpertBalancer(self.expert_recorder.layers, self.arch.num_layers,
                              self.config.eplb_rebalance_num_iterations, self.device)

    # ------------------------------------------------------------- weights
    def load_weights(self, model_path: str | None) -> None:
        """Swap in the weights of another checkpoint of the same architecture (SGLang's
        update_weights_from_disk: the model's config stays, only the weights change). A checkpoint of
        another shape raises ValueError and leaves the current weights in place."""
        arch, weights, source = load_model(model_path)
        if arch.shape_key() != self.arch.shape_key():
            raise ValueError(f"{model_path!r} is a different architecture ({arch.shape_key()}) than the loaded "
                             f"model ({self.arch.shape_key()})")
        self.release_weights()  # the old copy goes first: the peak is one model, not two
        self.model = self._build_model(weights, source)
        if self.lora is not None:
            self.lora.attach(self.model)
        self.model_path, self.model_source = model_path, source
        self.expert_recorder.attach(self.model)  # the new layers count into the same record
        self.eplb = self._expert_balancer()  # the new layers start from --init-expert-location again
        if self.page_pool.model:
            self.page_pool.model = self._identity(source)
        self._capture_graphs()
        logger.info("weights updated from %s", source.path)

    def model_families(self) -> list:
        """The model's own Prometheus families for ``RankMetrics``: the MoE all-to-all counters,
        while recording the expert load (``expert_recorder.py``), and with --enable-eplb what the
        balancer did (``eplb.py``); none for a dense model."""
        if self.model is None or not self.expert_recorder.has_experts:
            return []
        eplb = self.eplb.families() if self.eplb is not None else []
        return a2a_families(self.expert_recorder.layers.values()) + self.expert_recorder.families() + eplb

    def release_weights(self) -> None:
        """Free the weights (``resume_weights`` reloads them from ``model_path``)."""
        self.model = None
        self.expert_recorder.attach(None)  # its layers hold the weights too
        self.eplb = None  # and so do the balancer's
        self.graph_runner = None  # its graphs hold the weights too
        gc.collect()
        trim_heap()

    def resume_weights(self) -> None:
        if self.model is None:
            self.load_weights(self.model_path)

    def load_lora(self, loads: list[tuple[int, str]]) -> None:
        """Put each (slot, adapter) the scheduler placed into the model's LoRA slots."""
        for slot, name in loads:
            self.lora.load(slot, name)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [len(batch.logits_indices), vocab]. ``after_layer(i)``
        runs once layer i stored its KV (layer-wise KV send, ``kvtransfer/layer_signal.py``)."""
        if self.model is None:
            raise RuntimeError("the weights are released (resume_memory_occupation restores them)")
        batch = self._to_device(batch)
        graphs = self.graph_runner
        # a captured graph holds no expert counting or balancing and keeps no hidden states: such
        # steps run eagerly
        if (graphs is not None and after_layer is None and not self.expert_recorder.recording
                and self.eplb is None and not self.model.keep_hidden
                and graphs.can_run(batch)):
            return graphs.replay(batch)
        self.attn_backend.begin_forward(batch)
        dp_attention.join_forward(batch.input_ids.shape[0], batch.logits_indices.numel(), self.kind,
                                  self.idle_forward)
        self._balance_experts()
        return self.model.forward(batch, self.attn_backend, after_layer)

    @torch.inference_mode()
    def idle_forward(self, kind: int = dp_attention.TARGET) -> None:
        """Under DP attention: a forward of no rows beside another group's (``dp_attention.py``), of
        the model the round names: the target's, or for a ``DRAFT`` round the draft's."""
        idle = self.idle_forwards.get(kind)
        if idle is None:
            raise RuntimeError(f"DP attention: a round of kind {kind}, and this rank has no such model")
        idle()

    def _idle_own(self) -> None:
        self._balance_experts()
        self.model.idle_forward()

    def add_draft(self, idle: Callable[[], None]) -> None:
        """Under DP attention: ``idle`` answers the other groups' draft rounds (NEXTN's MTP layer)."""
        self.idle_forwards[dp_attention.DRAFT] = idle

    def join_draft_round(self, rows: int, sampled: int) -> None:
        """Under DP attention: open the round of a draft forward run beside this (target) runner
        (NEXTN's MTP step), answering the target rounds other groups still run meanwhile."""
        dp_attention.join_forward(rows, sampled, dp_attention.DRAFT, self.idle_forward)

    def draft_of(self, target: ModelRunner) -> None:
        """Make this runner a draft model beside ``target`` on the same rank (STANDALONE): under DP
        attention its forwards open draft rounds, and both runners answer every round alike."""
        self.kind = dp_attention.DRAFT
        target.add_draft(self._idle_own)
        self.idle_forwards = target.idle_forwards

    def _balance_experts(self) -> None:
        """``--enable-eplb``: count one forward and rebalance when due. Called once the forward's
        round is open and before the model's first collective, from ``forward`` and from
        ``idle_forward`` alike: under DP attention the groups run different numbers of forwards but
        every rank answers every round (its own forward or an idle one of the round's model), so
        every rank counts the same rounds of each model and reaches a rebalance's collectives at
        the same round."""
        if self.eplb is not None:
            self.eplb.step()

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
            tree_parents=batch.tree_parents,
            lora_slots=None if batch.lora_slots is None else batch.lora_slots.to(dev, torch.int64),
        )
