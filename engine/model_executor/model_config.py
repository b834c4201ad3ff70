"""ModelArch: the shape of a Llama-family model, read from a HF config.json or GGUF metadata.

One dataclass for every supported architecture; the differences between them
are flags (``attention_bias`` for Qwen2, ``qk_norm`` for Qwen3), so the model
code has one path with a few switches rather than a class per family.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

# HF ``model_type`` / GGUF ``general.architecture`` -> our family name
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "deepseek_v2", "deepseek_v3")
# multi-head latent attention: the KV pool holds one latent vector per token (kv_kind "latent")
MLA_ARCHS = ("deepseek_v2", "deepseek_v3")
# our family name -> the Hugging Face architecture (``models/registry.py`` serves it by that name)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM"}


def check_tp_heads(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError naming the numbers when the heads cannot be split ``tp_size`` ways (SGLang's
    rule: query heads divide evenly; KV heads are split when tp_size divides them, replicated when
    they divide tp_size)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    problems = []
    if num_heads % tp_size:
        problems.append(f"tp_size {tp_size} does not divide the {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        problems.append(f"tp_size {tp_size} does not divide the {num_kv_heads} KV heads, nor do they divide it")
    if problems:
        raise ValueError(
            f"tp_size {tp_size} cannot split this model's {num_heads} attention heads and {num_kv_heads} KV heads: "
            + "; ".join(problems)
            + " (attention heads must divide evenly; KV heads are split when tp_size divides them, "
            "replicated when they divide tp_size)"
        )


def check_no_checkpoint_quantization(cfg: dict) -> None:
    """Refuse a checkpoint stored quantized (``quantization_config`` in its config.json: FP8, AWQ,
    GPTQ, ...): pdserve loads weights as plain tensors, so it would run the packed integers or the
    unscaled FP8 values as if they were the weights and answer garbage. GGUF files need no check: the
    loader dequantizes every GGUF type it reads. pdserve's own ``--quantization w8a16`` starts from
    unquantized weights."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
    raise ValueError(
        f"the checkpoint is quantized with {method!r} (config.json quantization_config), which pdserve "
        "cannot apply; use an unquantized (bf16/fp16/fp32) checkpoint, or a GGUF file"
    )


@dataclass(frozen=True)
class ModelArch:
    arch: str  # one of SUPPORTED_ARCHS
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_context_len: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # llama3-style rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    rope_linear_factor: float = 1.0
    # the KV pool's kind (mem_cache/page_pool.py): "mha", or "latent" for multi-head latent attention,
    # whose pool has num_kv_heads 1 and head_dim the latent width
    kv_kind: str = "mha"
    # the checkpoint's config.json as read (JSON text; "" for GGUF), for a model class's own fields
    # (experts, sliding windows, ...) that no other part of the engine reads
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"architecture {self.arch!r} is not supported (supported: {SUPPORTED_ARCHS})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ValueError, naming the numbers, when this model cannot be split over ``tp_size`` ranks."""
        self.check_parallel(tp_size, tp_size)

    def check_parallel(self, attn_tp_size: int, mlp_tp_size: int) -> None:
        """``check_tp_size`` for heads split over ``attn_tp_size`` ranks and the MLP over
        ``mlp_tp_size`` (different under DP attention: the heads within a group, the MLP over all)."""
        check_tp_heads(attn_tp_size, self.num_heads, self.num_kv_heads)
        self.check_mlp_split(mlp_tp_size)

    def check_mlp_split(self, tp_size: int) -> None:
        """Raise ValueError when the dense MLP cannot be split over ``tp_size`` ranks (under DP
        attention the MLP splits over every rank while the heads split only within a group)."""
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tp_size {tp_size} does not divide the model's intermediate size {self.intermediate_size}"
            )

    def with_context_length(self, context_length: int) -> "ModelArch":
        """This model serving at most ``context_length`` tokens (``--context-length``). Longer than the
        model was trained for is refused, as SGLang refuses it by default: rope positions past the
        training length give garbage."""
        if context_length > self.max_context_len:
            raise ValueError(f"context_length {context_length} is longer than the model's "
                             f"{self.max_context_len} tokens (max_position_embeddings / context_length)")
        return dataclasses.replace(self, max_context_len=context_length)
    def shape_key(self) -> tuple:
        """What two checkpoints must share for one's weights to replace the other's in a loaded
        model (update_weights_from_disk): the tensor shapes and the layers' wiring."""
        return (self.arch, self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.intermediate_size, self.vocab_size, self.tie_word_embeddings, self.attention_bias, self.qk_norm)

    @property
    def architecture(self) -> str:
        """The Hugging Face architecture name the model registry serves this model by."""
        return HF_ARCHITECTURES[self.arch]

    # ------------------------------------------------------------ from HF
    @classmethod
    def from_hf_config(cls, cfg: dict, generation_cfg: dict | None = None) -> "ModelArch":
        """Build from a parsed ``config.json`` (and optional ``generation_config.json``)."""
        model_type = cfg.get("model_type", "")
        if model_type in MLA_ARCHS and cfg.get("quantization_config") is not None:
            from pdserve.engine.model_executor.fp8_block import check_fp8_block_config

            check_fp8_block_config(cfg["quantization_config"])  # dequantized at load by the model
        else:
            check_no_checkpoint_quantization(cfg)
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHS})")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 nests rope settings under rope_parameters; older files keep them flat
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        linear = 1.0
        if rope_type == "llama3":
            llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            linear = float(rope["factor"])
        elif rope_type != "default" and model_type not in MLA_ARCHS:  # DeepSeek's rope: layers/yarn_rope.py
            raise ValueError(f"rope scaling type {rope_type!r} is not supported")
        max_ctx = int(cfg.get("max_position_embeddings", 4096))
        # attention restricted to a window equals full attention for contexts inside it,
        # so a sliding-window model runs exactly when its context is capped at the window
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            max_ctx = min(max_ctx, int(window))
        eos: list[int] = []
        for source in (cfg, generation_cfg or {}):
            value = source.get("eos_token_id")
            for tok in value if isinstance(value, list) else [value]:
                if tok is not None and tok not in eos:
                    eos.append(int(tok))
        mla = model_type in MLA_ARCHS
        return cls(
            arch=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=num_heads,
            # MLA: one latent vector per token, shared by all heads
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] if mla else cfg.get("head_dim") or hidden // num_heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_context_len=max_ctx,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            rope_llama3_scaling=llama3,
            rope_linear_factor=linear,
            kv_kind="latent" if mla else "mha",
            hf_config=json.dumps(cfg, sort_keys=True),
        )

    def to_hf_config(self) -> dict:
        """A ``config.json`` that transformers loads as the same model (used to compare against it)."""
        if self.hf_config and self.arch not in ("llama", "mistral", "qwen2", "qwen3"):
            return json.loads(self.hf_config)
        model_type = self.arch
        cfg = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_context_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        if model_type == "mistral":
            cfg["sliding_window"] = None
        if self.rope_llama3_scaling is not None:
            f, lo, hi, orig = self.rope_llama3_scaling
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                   "high_freq_factor": hi, "original_max_position_embeddings": orig}
        elif self.rope_linear_factor != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.rope_linear_factor}
        return cfg

    # ---------------------------------------------------------- from GGUF
    @classmethod
    def from_gguf_metadata(cls, meta: dict, tensor_names: set[str]) -> "ModelArch":
        """Build from GGUF key/values (as read by ``model_loader``) and the file's tensor names."""
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2, qwen3)")
        if "rope_freqs.weight" in tensor_names:
            raise ValueError("GGUF files with rope_freqs (llama3 rope scaling) are not supported")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv = get("attention.head_count_kv", num_heads)
        vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens")  # reader gives a count for arrays
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        scaling = get("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
        return cls(
            arch=arch,
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            max_context_len=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            rope_linear_factor=float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        )
