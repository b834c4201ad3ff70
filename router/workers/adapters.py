"""Which LoRA adapters each worker serves, and which adapter a request names. Pure bookkeeping.

The router learns a worker's adapters from its ``GET /v1/models`` (each adapter is a card whose
``parent`` is the base model and whose ``root`` is its path, as pdserve, SGLang and vLLM list
them): when the worker is added and at every health probe, and from the ``loaded_adapters`` a
``/load_lora_adapter`` or ``/unload_lora_adapter`` answers. A request names an adapter as the
servers read it (engine/frontend/lora_fields.py): ``lora_path`` (on /generate one name, or one
per prompt), or, on the OpenAI routes, ``"model": "NAME"`` or ``"BASE:NAME"``.

Routing prefers the endpoints whose worker holds the request's adapters (``prefer``); when none
does, the caller loads the adapter on the endpoint its policy chose, from the path a worker listed
or ``--lora-paths`` gave (``path_of``). An adapter no worker serves and no path names is the
client's error (``AdapterError``, a 400 naming the field).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from pdserve.engine.lora_names import lora_id_of

E = TypeVar("E")  # an Endpoint (worker_registry.Endpoint): has .worker.url


class AdapterError(ValueError):
    """A request names an adapter the fleet does not serve and the router cannot load."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def models_adapters(payload: Any) -> tuple[list[str], dict[str, str]]:
    """(base model ids, {adapter name: path}) of a ``/v1/models`` answer; nothing for another shape."""
    data = payload.get("data") if isinstance(payload, dict) else None
    bases: list[str] = []
    adapters: dict[str, str] = {}
    for card in data if isinstance(data, list) else ():
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        if card.get("parent") is None:
            bases.append(card["id"])
        else:
            root = card.get("root")
            adapters[card["id"]] = root if isinstance(root, str) else ""
    return bases, adapters


def loaded_adapters(payload: Any) -> dict[str, str] | None:
    """The ``loaded_adapters`` {name: path} of a load or unload answer; None when it has none."""
    loaded = payload.get("loaded_adapters") if isinstance(payload, dict) else None
    if not isinstance(loaded, dict):
        return None
    return {k: v if isinstance(v, str) else "" for k, v in loaded.items() if isinstance(k, str)}


class AdapterTable:
    """Adapters per worker URL, the base model names the workers report, and the paths known by
    name (``--lora-paths`` first, then what workers list)."""

    def __init__(self, configured: dict[str, str] | None = None):
        self.configured = dict(configured or {})
        self._held: dict[str, dict[str, str]] = {}  # worker url -> {name: path}
        self._bases: dict[str, list[str]] = {}  # worker url -> its base model ids

    # what the workers say ------------------------------------------------
    def set_models(self, url: str, payload: Any) -> None:
        """Record a worker's ``/v1/models`` answer."""
        bases, adapters = models_adapters(payload)
        if bases:
            self._bases[url] = bases
        self._held[url] = adapters

    def set_loaded(self, url: str, loaded: dict[str, str]) -> None:
        """Record the adapters a worker holds after a load or an unload."""
        self._held[url] = dict(loaded)

    def add(self, url: str, name: str, path: str) -> None:
        """``name`` was loaded on the worker ``url``."""
        self._held.setdefault(url, {})[name] = path

    def forget(self, url: str) -> None:
        """The worker left the registry."""
        self._held.pop(url, None)
        self._bases.pop(url, None)

    # what routing asks -----------------------------------------------------
    def held(self, url: str) -> dict[str, str]:
        return self._held.get(url, {})

    def union(self) -> dict[str, str]:
        """Every adapter any worker holds, with a path for it (a configured one first), by name."""
        out: dict[str, str] = {}
        for held in self._held.values():
            for name, path in held.items():
                out.setdefault(name, self.configured.get(name) or path)
        return out

    @property
    def active(self) -> bool:
        """Adapters are in play: some worker holds one or ``--lora-paths`` names one. Without,
        the router reads no adapter from requests (their workers answer for them)."""
        return bool(self.configured) or any(self._held.values())

    def bases(self) -> set[str]:
        return {b for bases in self._bases.values() for b in bases}

    def path_of(self, name: str) -> str | None:
        """Where adapter ``name`` is read from: ``--lora-paths``, else a worker's listing."""
        if name in self.configured:
            return self.configured[name]
        for held in self._held.values():
            if held.get(name):
                return held[name]
        return None

    def known(self, name: str) -> bool:
        return name in self.configured or any(name in held for held in self._held.values())

    def request_adapters(self, body: dict) -> frozenset[str]:
        """The adapters ``body`` names (empty: the base model); AdapterError for one the router
        neither sees on a worker nor can load. ``model`` counts as an adapter when it is a known
        adapter's name or ``BASE:NAME`` with a base model the workers serve; another model name
        is left to the workers to refuse."""
        if not self.active:
            return frozenset()
        lora = body.get("lora_path")
        if lora is not None:
            names = lora if isinstance(lora, list) else [lora]
            return frozenset(self._check(n, "lora_path") for n in names if n is not None)
        model = body.get("model")
        if not isinstance(model, str) or model in self.bases():
            return frozenset()
        if self.known(model):
            return frozenset((model,))
        base, sep, name = model.rpartition(":")
        if sep and base in self.bases():
            return frozenset((self._check(name, "model"),))
        return frozenset()

    def _check(self, name: Any, param: str) -> str:
        if not isinstance(name, str):
            raise AdapterError(f"{param} must be an adapter name (a string), got {type(name).__name__}", param)
        if not self.known(name):
            served = sorted(self.union()) or sorted(self.configured)
            raise AdapterError(f"{param}: unknown LoRA adapter {name!r}; the workers serve "
                               f"{', '.join(served) or 'none'}", param)
        return name

    def namespace(self, adapters: frozenset[str]) -> int:
        """The prefix-cache namespace (``lora_id``) the workers key one adapter's pages in, from
        its name and path as they load it; 0 for none, several, or an unknown path."""
        if len(adapters) != 1:
            return 0
        (name,) = adapters
        path = self.path_of(name)
        return lora_id_of(name, path) if path else 0

    def prefer(self, endpoints: Sequence[E], adapters: Iterable[str]) -> Sequence[E]:
        """Those of ``endpoints`` whose worker holds every adapter of ``adapters``, else those
        holding the most of them, else all (the policy's choice then loads them)."""
        want = frozenset(adapters)
        if not want or len(endpoints) < 2:
            return endpoints
        scored = [(len(want & self.held(e.worker.url).keys()), e) for e in endpoints]
        best = max(s for s, _ in scored)
        if best == 0:
            return endpoints
        return [e for s, e in scored if s == best]

    def missing(self, url: str, adapters: Iterable[str]) -> list[tuple[str, str]]:
        """(name, path) of each of ``adapters`` the worker ``url`` does not hold, to load there;
        a name without a known path is left out (its worker answers for it)."""
        held = self.held(url)
        out = []
        for name in sorted(adapters):
            if name not in held:
                path = self.path_of(name)
                if path:
                    out.append((name, path))
        return out
