"""Adapters loaded and unloaded at run time on one scheduler rank (SGLang's /load_lora_adapter and
/unload_lora_adapter), between its steps; ``rank_control.py`` dispatches the messages here.

Loading reads the PEFT checkpoint into host memory and names its prefix-cache namespace; its
weights enter a slot when a request first uses it. Unloading is refused while any request on the
rank (waiting, compiling its grammar, running, or in a PD queue) uses the adapter, so an adapter
never changes under a running request; the KV cached under it is left to the cache's eviction (its
namespace is never matched again unless the same name is loaded from the same path).
"""

from __future__ import annotations

from pdserve.engine.lora_names import lora_id_of, parse_lora_paths
from pdserve.engine.model_executor.layers.lora_slots import AdapterInUse


class LoraControlError(ValueError):
    """A load or unload the rank refuses; the message names the adapter and why."""


def _manager(loop):
    lora = loop.runner.lora
    if lora is None:
        raise LoraControlError("this server was started without --enable-lora")
    return lora


def load_adapter(loop, name: str, path: str) -> str:
    """Serve adapter ``name`` from ``path``; returns the success message."""
    lora = _manager(loop)
    try:
        parse_lora_paths((f"{name}={path}",))  # the names --lora-paths accepts
    except ValueError as e:
        raise LoraControlError(str(e).replace("lora_paths", "lora_name", 1)) from None
    lora.add(name, path)  # LoraAdapterError (a ValueError): already loaded, or what does not fit
    loop.lora_ids[name] = lora_id_of(name, path)
    loop.cache.name_adapter(loop.lora_ids[name], path)
    loop.num_lora_host_loads += 1
    return f"LoRA adapter {name!r} loaded from {path}"


def requests_on(loop, name: str) -> int:
    """The rank's requests that run, or will, under adapter ``name``."""
    return sum(1 for req in loop.live_requests() if req.lora_name == name)


def unload_adapter(loop, name: str) -> str:
    """Stop serving adapter ``name``; returns the success message."""
    lora = _manager(loop)
    if name not in loop.lora_ids:
        raise LoraControlError(f"LoRA adapter {name!r} is not loaded")
    n = requests_on(loop, name)
    if n:
        raise LoraControlError(f"LoRA adapter {name!r} is in use by {n} request(s); unload it when they finish")
    try:
        slot = loop.scheduler.lora_slots.unload(name)
    except AdapterInUse as e:
        raise LoraControlError(str(e)) from None
    lora.remove(name, slot)
    del loop.lora_ids[name]
    return f"LoRA adapter {name!r} unloaded"
