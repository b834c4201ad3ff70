"""Which LoRA adapter a request names: SGLang's ``lora_path`` (on /generate, per prompt in a
batch, and on the OpenAI routes) or, on the OpenAI routes, ``model``: ``"BASE:NAME"`` (SGLang's
form) or the adapter's name alone (vLLM's). An explicit ``lora_path`` wins over ``model``.

A name the server does not serve is a 400 naming the field and the adapter, as is any adapter
on a server started without ``--enable-lora``.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.frontend.request_error import RequestError


def _check(name: Any, adapters: frozenset[str], param: str) -> str:
    if not isinstance(name, str):
        raise RequestError(f"{param} must be an adapter name (a string), got {type(name).__name__}", param=param)
    if not adapters:
        raise RequestError(f"{param} names LoRA adapter {name!r}, but this server was started without "
                           "--enable-lora", param=param, code="unsupported")
    if name not in adapters:
        raise RequestError(f"{param}: unknown LoRA adapter {name!r}; this server serves "
                           f"{', '.join(sorted(adapters))}", param=param, code="lora_not_found")
    return name


def generate_adapters(lora_path: Any, num_prompts: int, adapters: frozenset[str]) -> list[str | None]:
    """/generate's ``lora_path``: None, one name for every prompt, or a list of one name (or
    null) per prompt."""
    if lora_path is None:
        return [None] * num_prompts
    if isinstance(lora_path, list):
        if len(lora_path) != num_prompts:
            raise RequestError(f"lora_path has {len(lora_path)} entries for {num_prompts} prompts", param="lora_path")
        return [None if p is None else _check(p, adapters, "lora_path") for p in lora_path]
    return [_check(lora_path, adapters, "lora_path")] * num_prompts


def openai_adapter(lora_path: Any, model: str | None, model_names: frozenset[str],
                   adapters: frozenset[str]) -> str | None:
    """The adapter of an OpenAI request, or None for the base model; ``model`` is checked here
    (a base name, an adapter's name, or ``BASE:NAME``)."""
    if lora_path is not None:
        name = _check(lora_path, adapters, "lora_path")
        if model is not None and model not in model_names:
            openai_adapter(None, model, model_names, adapters)  # model must still name this server
        return name
    if model is None or model in model_names:
        return None
    if model in adapters:
        return model
    base, sep, name = model.rpartition(":")
    if sep and base in model_names:
        return _check(name, adapters, "model")
    raise RequestError(f"The model `{model}` does not exist; this server serves {sorted(model_names)[0]!r}"
                       + (f" and LoRA adapters {', '.join(sorted(adapters))}" if adapters else ""),
                       param="model", code="model_not_found")
