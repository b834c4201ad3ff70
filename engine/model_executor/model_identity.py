"""The model's identity in a KV layout: which model and weights made a page's KV bytes.

Two fine-tunes of one base have the same KV layout (layers, heads, head dim, dtype), so the PD
pairing check compares this too: ``ARCH weights FINGERPRINT DTYPE QUANTIZATION``. The fingerprint
hashes each weight file's name, size and three 1 MiB samples of its bytes (start, middle, end):
weights that differ anywhere in practice differ there (a fine-tune changes every tensor), while
copies of one checkpoint on different nodes agree (no path or mtime in it), and it costs a few
MiB of reads, not a pass over the checkpoint.
"""

from __future__ import annotations

import hashlib
import os

SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def _sample(h, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}\n".encode())
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))


def weights_fingerprint(path: str) -> str:
    """12 hex digits naming the weight files at ``path`` (a file, or a directory's weight files)."""
    h = hashlib.blake2b(digest_size=6)
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(path, name)):
                _sample(h, os.path.join(path, name))
    elif os.path.isfile(path):
        _sample(h, path)
    return h.hexdigest()


def model_identity(arch: str, weights_path: str, dtype: str, quantization: str) -> str:
    return f"{arch} weights {weights_fingerprint(weights_path)} {dtype} {quantization}"
