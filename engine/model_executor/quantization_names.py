"""The weights' quantizations by name (``quantization.py`` implements them).

Apart from the torch code so that the configs, the CLI and the KV transfer messages (which pair a
prefill and a decode by it) can name them without importing torch.
"""

from __future__ import annotations

UNQUANTIZED = "none"
QUANTIZATIONS = (UNQUANTIZED, "w8a16")


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {name!r}")
