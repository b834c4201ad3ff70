"""One frozen config for the engine-server process kind (``pdserve serve``).

It composes the ``EngineConfig`` (model, KV cache, scheduling: what each DP
rank needs) and the ``KVTransferConfig`` (transfer backend, bootstrap port, KV
timeouts: what each PD rank's KV manager needs) with what only the server needs
(HTTP, DP ranks, auth, limits, disaggregation mode). The CLI builds its flags
and defaults from the fields of the three dataclasses, so no default is written
twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import pdserve.engine.env as env
from pdserve.engine.config import DISAGGREGATION_MODES, EngineConfig
from pdserve.engine.secret_files import read_key
from pdserve.engine.http_limits import (HTTP_HEADER_TIMEOUT, HTTP_READ_TIMEOUT, MAX_CONNECTIONS, MAX_REQUEST_BYTES,
                                        HttpLimits)
from pdserve.engine.tracing import DEFAULT_ENDPOINT, TraceConfig
from pdserve.engine.text.reasoning_parsers import REASONING_PARSERS
from pdserve.engine.text.tool_parsers import TOOL_CALL_PARSERS
from pdserve.engine.kv_events_config import KVEventsConfig
from pdserve.engine.model_executor.sampling_defaults import SAMPLING_DEFAULTS
from pdserve.engine.kv_transfer_config import KVTransferConfig

LOG_LEVELS = ("debug", "info", "warning", "error")
# KVTransferConfig field -> its flag's name (``--disaggregation-...``, SGLang's); the other fields are not flags
KV_FLAGS = {
    "backend": "disaggregation_transfer_backend",
    "ib_device": "disaggregation_ib_device",
    "bootstrap_port": "disaggregation_bootstrap_port",
    "bootstrap_timeout": "disaggregation_bootstrap_timeout",
    "waiting_timeout": "disaggregation_waiting_timeout",
    "quarantine_timeout": "disaggregation_quarantine_timeout",
    "heartbeat_interval": "disaggregation_heartbeat_interval",
    "heartbeat_max_failures": "disaggregation_heartbeat_max_failures",
    "auth_key_file": "disaggregation_auth_key_file",
    "auth_previous_key_file": "disaggregation_auth_previous_key_file",
    "allow_unauthenticated": "disaggregation_allow_unauthenticated",
    "bootstrap_allowlist": "disaggregation_bootstrap_allowlist",
    "layerwise": "disaggregation_layerwise",
}


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    dp_size: int = 1
    # tensor parallel (SGLang's flags): each DP rank is tp_size processes joined by torch.distributed
    tp_size: int = 1
    # SGLang's --enable-dp-attention: the dp_size DP ranks are attention groups of one server of
    # tp_size ranks (dp_attention.py): each its own scheduler, KV pool and batch, the dense and MoE
    # layers split over all of them; attention groups of tp_size / dp_size processes each
    enable_dp_attention: bool = False
    # host:port where DP rank r's TP group meets (port + r); None: a free local port per DP rank
    # (one node). Needed when one DP rank spans nodes (nnodes > 1): the address of node 0.
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_timeout: float = 300.0  # seconds a TP collective may wait (a dead peer fails it at once)
    base_gpu_id: int = 0  # CUDA: DP rank r's TP rank t runs on device base_gpu_id + r * tp_size + t
    api_key: str | None = None
    # the control routes' key (engine/frontend/control_access.py): from the flag, its file, or
    # PDSERVE_ADMIN_API_KEY; without one the control routes answer only loopback peers
    admin_api_key: str | None = field(default=None, repr=False)
    admin_api_key_file: str | None = None
    # the folder /start_profile writes under (SGLang's SGLANG_TORCH_PROFILER_DIR); None: the
    # environment's, and without either profiling is refused
    profile_dir: str | None = None
    # seconds a client may take to send a request's body: a slow client is answered 408
    http_read_timeout: float = HTTP_READ_TIMEOUT
    # seconds a connection may go without a whole request head, from its start and from each
    # answer (slowloris, idle keep-alive): then it is closed; the bootstrap server's too
    http_header_timeout: float = HTTP_HEADER_TIMEOUT
    # open connections the HTTP listener (and the bootstrap server's) keeps; more are answered 503
    max_connections: int = MAX_CONNECTIONS
    # seconds a generation request may take before it is aborted (504, or an error event when
    # streamed); None: no deadline
    request_timeout: float | None = None
    # /health answers 503 while a DP rank that has work has not reported for this many seconds
    health_scheduler_timeout: float = 60.0
    log_level: str = "info"
    served_model_name: str | None = None  # None: the model path's name (or the default model's)
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger bodies get 413
    max_n: int = 8  # most choices per OpenAI request
    # SGLang's flag: "model" takes the OpenAI endpoints' sampling defaults from the model's
    # generation_config.json (or GGUF metadata), "openai" keeps OpenAI's (sampling_defaults.py)
    sampling_defaults: str = "model"
    # GET /metrics (SGLang's flag; on by default here, as pdserve always served it: --no-enable-metrics)
    enable_metrics: bool = True
    # disaggregation; kv_transfer.host is replaced by advertise_host where the ranks run
    disaggregation_mode: str = "null"
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # seconds the launcher waits for every rank to load its model
    startup_timeout: float = 600.0
    # SIGTERM drains: new requests get 503 + Retry-After, /health 503, requests in flight get this
    # long to finish before the rest end with an error (SGLang's flag); 0 stops at once
    graceful_shutdown_timeout: float = 60.0
    # KV cache events, SGLang's/vLLM's JSON flag (see kv_events_config.py); None: none published
    kv_events_config: str | None = None
    # decode mode: a prompt of at most this many tokens may come without bootstrap fields and is
    # prefilled here, in the running batch (conditional disaggregation); 0: never
    max_local_prefill_tokens: int = 0
    # streamed /generate and Engine.generate(stream=True): False (SGLang's default) sends the whole
    # text and output_ids so far in each chunk; True only what is new since the previous chunk
    incremental_streaming_output: bool = False
    # SGLang's --tool-call-parser: how tool_choice auto finds tool calls in the output; None: auto is refused
    tool_call_parser: str | None = None
    # OpenTelemetry traces (SGLang's flags; engine/tracing.py): off by default, OTLP/HTTP protobuf
    enable_trace: bool = False
    otlp_traces_endpoint: str = DEFAULT_ENDPOINT
    trace_sample_ratio: float = 1.0
    # SGLang's --reasoning-parser: chat outputs split into reasoning_content and content; None: no split
    reasoning_parser: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "admin_api_key", read_key("admin-api-key", self.admin_api_key,
                                                           self.admin_api_key_file, env.PDSERVE_ADMIN_API_KEY))
        object.__setattr__(self, "admin_api_key_file", None)  # read once; a copy of the config keeps the key
        if self.profile_dir is None and env.PDSERVE_TORCH_PROFILER_DIR:
            object.__setattr__(self, "profile_dir", env.PDSERVE_TORCH_PROFILER_DIR)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        self._check_parallel()
        self.trace  # raises on a bad --trace-sample-ratio or --otlp-traces-endpoint
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not self.http_read_timeout > 0:
            raise ValueError(f"http_read_timeout must be > 0, got {self.http_read_timeout}")
        HttpLimits(self.http_header_timeout, self.max_connections)  # raises on a bad one
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if not self.health_scheduler_timeout > 0:
            raise ValueError(f"health_scheduler_timeout must be > 0, got {self.health_scheduler_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be >= 0, got {self.max_local_prefill_tokens}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"sampling_defaults must be one of {SAMPLING_DEFAULTS}, got {self.sampling_defaults!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}"
            )
        KVEventsConfig.from_json(self.kv_events_config)  # a bad flag fails here, before any rank starts
        self.kv_transfer.check_exposure(self.disaggregation_mode, self.host)
        if not 0 < self.kv_transfer.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be in [1, 65535], got {self.kv_transfer.bootstrap_port}")

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.tp_size % self.engine.ep_size:
            raise ValueError(f"ep_size {self.engine.ep_size} must divide tp_size {self.tp_size}")
        if self.engine.moe_a2a_backend != "none" and self.engine.ep_size not in (1, self.tp_size):
            raise ValueError(f"moe_a2a_backend {self.engine.moe_a2a_backend!r} needs ep_size equal to tp_size, "
                             f"got ep_size {self.engine.ep_size}, tp_size {self.tp_size}")
        if self.enable_dp_attention:
            self._check_dp_attention()
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank {self.node_rank}, nnodes {self.nnodes}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            # DP rank r's group meets at port + r; under DP attention across nodes port + 1 is the
            # front end's rank channel (rank_channel_addr)
            ports = 2 if self.enable_dp_attention and self.nnodes > 1 else self.dp_size
            if not host or not port.isdigit() or not 0 < int(port) + ports <= 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                raise ValueError("nnodes > 1 needs dist_init_addr (node 0's host:port)")
            if self.enable_dp_attention:
                self._check_dp_attention_nodes()
            elif self.dp_size != 1 or self.tp_size % self.nnodes:
                raise ValueError(
                    f"nnodes > 1 spans one DP rank over the nodes: needs dp_size 1 and tp_size divisible by "
                    f"nnodes, got dp_size {self.dp_size}, tp_size {self.tp_size}, nnodes {self.nnodes}"
                )

    def _check_dp_attention(self) -> None:
        """What DP attention serves: attention groups of tp_size / dp_size processes (across nodes,
        ``_check_dp_attention_nodes``), no DeepEP, no LoRA (the model's own check refuses
        architectures without an idle forward). Speculation: NGRAM (a verify step is a target
        forward of more rows), STANDALONE and NEXTN (the draft's steps are rounds of their own kind,
        ``dp_attention.py``), NEXTN in PD too: the prefill's MTP forwards over the prompt are draft
        rounds like the decode's draft steps (``speculative/nextn_prompt.py``)."""
        if self.tp_size % self.dp_size:
            raise ValueError(f"enable_dp_attention needs dp_size dividing tp_size, got dp_size {self.dp_size}, "
                             f"tp_size {self.tp_size}")
        refused = [(self.engine.moe_a2a_backend == "deepep", "moe_a2a_backend 'deepep'"),
                   # the MLP gathers every group's rows, whose LoRA slots are each group's own
                   (self.engine.enable_lora, "enable_lora")]
        for bad, what in refused:
            if bad:
                raise ValueError(f"enable_dp_attention is not supported with {what}")

    def _check_dp_attention_nodes(self) -> None:
        """DP attention over ``nnodes``: node n holds world ranks [n * tp_size / nnodes, (n + 1) *
        tp_size / nnodes), so every node holds whole attention groups (the group size divides a
        node's share) or every group spans whole nodes (a node's share divides the group size);
        a group cut anywhere else would straddle a node partly."""
        per_node, attn = self.tp_size // self.nnodes, self.attn_tp_size
        if self.tp_size % self.nnodes or (per_node % attn and attn % per_node):
            raise ValueError(
                f"--enable-dp-attention with --nnodes {self.nnodes}: every node must hold whole attention groups "
                f"or every group whole nodes (--tp-size divisible by --nnodes, and the group size --tp-size / "
                f"--dp-size dividing or divided by --tp-size / --nnodes), got --tp-size {self.tp_size}, "
                f"--dp-size {self.dp_size}, --nnodes {self.nnodes}")

    @property
    def attn_tp_size(self) -> int:
        """The processes of one DP rank: tp_size, or under DP attention its attention group's."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    def rank_device(self, dp_rank: int, tp_rank: int) -> str:
        """The device of one scheduler process: one CUDA device per scheduler process of this node,
        counted from base_gpu_id in world-rank order."""
        if self.engine.device.startswith("cuda"):
            first = self.node_rank * self.world_ranks_per_node
            return f"cuda:{self.base_gpu_id + dp_rank * self.attn_tp_size + tp_rank - first}"
        return self.engine.device

    @property
    def world_ranks_per_node(self) -> int:
        """Scheduler processes per node: every DP rank's TP ranks on one node; across nodes a
        node's share of the one world (multi-node TP's, or DP attention's)."""
        return self.dp_size * self.attn_tp_size // self.nnodes

    def node_of(self, dp_rank: int, tp_rank: int) -> int:
        """The node that runs DP rank ``dp_rank``'s TP rank ``tp_rank``: world rank ``dp_rank *
        attn_tp_size + tp_rank`` over consecutive shares of ``world_ranks_per_node``."""
        return (dp_rank * self.attn_tp_size + tp_rank) // self.world_ranks_per_node

    def local_ranks(self) -> list[tuple[int, int]]:
        """The (DP rank, TP rank) pairs that run on this node, in world-rank order (all of them on
        one node)."""
        per, attn = self.world_ranks_per_node, self.attn_tp_size
        return [(w // attn, w % attn) for w in range(self.node_rank * per, (self.node_rank + 1) * per)]

    @property
    def host_ranks(self) -> int:
        """The scheduler ranks of this server on this node: they share one CPU memory budget."""
        return self.world_ranks_per_node

    @property
    def rank_channel_addr(self) -> str | None:
        """Where ranks off node 0 reach node 0's front end under DP attention across nodes: a
        ZMQ ROUTER at ``--dist-init-addr``'s host, port + 1 (the world meets at port itself), so
        no node needs another flag to find it (``rank_transport.ZmqTransport``); None otherwise
        (every rank reaches it over ipc)."""
        if not (self.enable_dp_attention and self.nnodes > 1):
            return None
        host, _, port = self.dist_init_addr.rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"

    def rank_channel_auth(self):
        """The ``FrameAuth`` that seals every frame of the rank channel, from
        ``--disaggregation-auth-key-file``; None without a key (the channel is then as open as
        the torch rendezvous and gloo ports beside it)."""
        return self.kv_transfer.frame_auth("ranks")

    @property
    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.from_json(self.kv_events_config)

    @property
    def advertise_host(self) -> str:
        """The address peers reach this server's KV manager at (the bind host, unless a wildcard)."""
        if self.host in ("", "0.0.0.0", "::"):
            import socket

            return socket.gethostbyname(socket.gethostname())
        return self.host

    @property
    def bootstrap_host(self) -> str:
        """Where this server's prefill ranks register: its bootstrap server, which runs on node 0
        only (entrypoints/serve.py). On one node that is this host; with ``--nnodes N`` it is node
        0's, the host of ``--dist-init-addr``, on every node (a rank on node k registering at its own
        address would find no bootstrap server there, and decodes would wait for it in vain)."""
        if self.nnodes > 1:
            return self.dist_init_addr.rpartition(":")[0].strip("[]")
        return self.advertise_host

    def kv_transfer_config(self) -> KVTransferConfig:
        """The ``KVTransferConfig`` of this server's ranks: ``kv_transfer`` at the address peers reach."""
        return dataclasses.replace(self.kv_transfer, host=self.advertise_host)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.engine.model_path:
            return self.engine.model_path.rstrip("/").split("/")[-1]
        return "SmolLM2-135M-Instruct"

    @classmethod
    def from_flags(cls, values: dict) -> "ServerConfig":
        """A config from flat flag names (the ``serve`` CLI's dests, the offline Engine's keyword
        arguments): EngineConfig's fields, the server's own, and the KV transfer flags of
        ``KV_FLAGS``; a missing one takes its dataclass default. ValueError names an unknown one."""
        kv_by_flag = {flag: name for name, flag in KV_FLAGS.items()}
        engine_names, server_names = EngineConfig.field_names(), set(cls.server_field_names())
        unknown = sorted(set(values) - engine_names - server_names - set(kv_by_flag))
        if unknown:
            raise ValueError(f"unknown argument {unknown[0]!r}")
        return cls(
            engine=EngineConfig(**{k: v for k, v in values.items() if k in engine_names}),
            kv_transfer=KVTransferConfig(**{kv_by_flag[k]: v for k, v in values.items() if k in kv_by_flag}),
            **{k: v for k, v in values.items() if k in server_names},
        )

    @property
    def http_limits(self) -> HttpLimits:
        """The limits of this server's listeners (HTTP and bootstrap)."""
        return HttpLimits(self.http_header_timeout, self.max_connections)

    @property
    def trace(self) -> TraceConfig:
        """What the tracing flags say (``make_tracer`` takes it)."""
        return TraceConfig(self.enable_trace, self.otlp_traces_endpoint, self.trace_sample_ratio)

    @classmethod
    def server_field_names(cls) -> list[str]:
        """The server's own fields (everything but the composed ``engine`` and ``kv_transfer``)."""
        return [f.name for f in fields(cls) if f.name not in ("engine", "kv_transfer")]
