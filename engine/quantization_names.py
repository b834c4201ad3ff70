"""The weights' quantizations by name (``quantization.py`` implements them).

Apart from the torch code so that the configs, the CLI and the KV transfer messages (which pair a
prefill and a decode by it) can name them without importing torch.
"""

from __future__ import annotations

UNQUANTIZED = "none"
# w8a16: int8 weights, activations in the model dtype; w8a8: the same weights, and a large step's
# activations int8 per token (quantization.py)
W8A16, W8A8 = "w8a16", "w8a8"
QUANTIZATIONS = (UNQUANTIZED, W8A16, W8A8)


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {name!r}")
