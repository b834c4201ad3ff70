"""LoRA serving's flags (SGLang's ``--enable-lora``, ``--lora-paths``, ``--max-loras-per-batch``,
``--max-lora-rank``): their parsing and the combinations refused at start, importable without torch.

The adapters themselves are read by ``model_executor/layers/lora_adapter.py`` and applied by
``model_executor/lora_manager.py``; this module is what the configs and the CLI need.
"""

from __future__ import annotations

import hashlib

from pdserve.engine.quantization_names import UNQUANTIZED


def parse_lora_paths(entries: tuple[str, ...]) -> dict[str, str]:
    """``NAME=PATH`` or ``PATH`` (the path is then the name, as in SGLang) -> {name: path}, in
    order; ValueError naming ``lora_paths`` for an empty part, a JSON entry or a repeated name."""
    out: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"lora_paths entries must be NAME=PATH or PATH, got {entry!r}")
        if entry.lstrip().startswith("{"):
            raise ValueError(f"lora_paths takes NAME=PATH or PATH; SGLang's JSON entries are not supported: {entry!r}")
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = entry, entry
        if not name or not path:
            raise ValueError(f"lora_paths entry {entry!r} has an empty name or path")
        if ":" in name:
            # "base:NAME" in an OpenAI request's model field splits at the colon
            raise ValueError(f"lora_paths adapter name {name!r} must not contain ':'")
        if name in out:
            raise ValueError(f"lora_paths names adapter {name!r} twice")
        out[name] = path
    return out


def lora_id_of(name: str, path: str) -> int:
    """The prefix-cache namespace of adapter ``name`` read from ``path``: a stable hash in
    [1, 2**31), the same on every rank and server that serves it (the prefill and decode of a room,
    the router's KV events), and a new one when a name is loaded again from another path, so KV
    computed under the old weights is never reused."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**31 - 1) + 1


def check_lora(enable_lora: bool, lora_paths: tuple[str, ...], max_loras_per_batch: int,
               max_lora_rank: int | None, quantization: str, speculative_algorithm: str | None) -> None:
    """Raise ValueError naming the field that is out of range or cannot combine with LoRA."""
    parse_lora_paths(lora_paths)
    if max_loras_per_batch < 1:
        raise ValueError(f"max_loras_per_batch must be >= 1, got {max_loras_per_batch}")
    if max_lora_rank is not None and max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
    if not enable_lora:
        return
    if quantization != UNQUANTIZED:
        raise ValueError(f"enable_lora applies adapters over unquantized (bf16 or float32) weights; quantization "
                         f"{quantization!r} is not supported with LoRA")
    if speculative_algorithm is not None:
        raise ValueError(f"enable_lora cannot combine with speculative_algorithm {speculative_algorithm!r}")
