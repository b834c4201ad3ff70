"""The model's own sampling defaults (SGLang's ``--sampling-defaults model``).

A model's authors publish the sampling settings it was tuned for: a Hugging
Face checkpoint in ``generation_config.json``, a GGUF file in its
``general.sampling.*`` metadata (llama.cpp's keys). With ``--sampling-defaults
model`` (SGLang's default) they replace OpenAI's defaults (temperature 1, top_p
1) for the fields an OpenAI request leaves out; ``openai`` keeps OpenAI's.
SGLang's ``/generate`` keeps its own defaults either way, and so does pdserve's.

The bundled SmolLM2-135M-Instruct GGUF carries no sampling metadata, and its
Hugging Face release's generation_config.json has none either; its model
card's example uses temperature 0.2 and top_p 0.9, which stand in for them.
"""

from __future__ import annotations

import json
import os

SAMPLING_DEFAULTS = ("openai", "model")
# generation_config.json key -> the request field it is the default of
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's model card


def model_sampling_defaults(model_path: str | None) -> dict[str, float | int]:
    """The request fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``)
    the model sets, with its values; {} when it sets none."""
    # here, not at the top: the config and the CLI import SAMPLING_DEFAULTS without torch
    from pdserve.engine.model_executor.model_loader import read_gguf_header
    from pdserve.engine.model_source import resolve_model_path

    source = resolve_model_path(model_path)
    if source.format == "gguf":
        meta = read_gguf_header(source.path)[0]
        found = {field: meta[key] for key, field in GGUF_KEYS.items() if key in meta}
        return found or (dict(DEFAULT_MODEL_SAMPLING) if model_path is None else {})
    path = os.path.join(source.path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    return {field: cfg[key] for key, field in HF_KEYS.items() if cfg.get(key) is not None}
