"""Keys of the storage tier: a page's chained hash, namespaced by what makes its KV bytes differ.

Two servers may share a page only if they compute the same bytes for it: the
same model and weights (path, file sizes and modification times: a fine-tune
in place changes them), dtype, weight quantization, page size, layer count,
and the same KV heads (a TP rank holds a head range; ranks of different TP
sizes hold different ranges). All of that is hashed into the namespace, so an
incompatible server never reads another's pages: it simply misses. A latent pool
(MLA: one vector per token, the same on every TP rank) is named by its kind and
width instead of a head range, so every TP rank of every TP size shares its pages.

A page computed under a LoRA adapter is keyed in that adapter's namespace too: its identity
(the ``lora_id`` its name and path give, the path's files' sizes and mtimes: an adapter retrained
in place gets a new one) under the model's. Its chained hash is already salted by the adapter
(``radix_cache.cache_key``); the extra path part makes an adapter's pages in a shared store
visible by key and keeps a retrained adapter from reading its old pages. Base pages keep the key
they had without LoRA.
"""

from __future__ import annotations

import hashlib
import os

from pdserve.engine.mem_cache.page_pool import KVLayout


def weights_identity(path: str) -> str:
    """The model files' names, sizes and mtimes (a file, or a directory's top level)."""
    entries = []
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full):
                st = os.stat(full)
                entries.append(f"{name}:{st.st_size}:{int(st.st_mtime)}")
    elif os.path.exists(path):
        st = os.stat(path)
        entries.append(f"{os.path.basename(path)}:{st.st_size}:{int(st.st_mtime)}")
    return ";".join(entries)


def kv_namespace(model_path: str, layout: KVLayout, kv_start: int) -> str:
    """16 hex digits naming the KV bytes this rank computes (see the module docstring)."""
    parts = [
        os.path.realpath(model_path), weights_identity(model_path), layout.dtype, layout.quantization,
        str(layout.page_size), str(layout.num_layers), str(layout.head_dim),
        _heads_part(layout, kv_start),
    ]
    if layout.kind != "mha":  # a latent page is not a head's page; MHA namespaces stay as they were
        parts.append(f"kind {layout.kind}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def _heads_part(layout: KVLayout, kv_start: int) -> str:
    if layout.kind == "latent":
        return f"latent {layout.head_dim}"
    return f"heads {kv_start}..{kv_start + layout.num_kv_heads}"


def adapter_namespace(lora_id: int, path: str) -> str:
    """16 hex digits naming the KV bytes adapter ``lora_id`` (read from ``path``) adds (see above)."""
    parts = [str(lora_id), os.path.realpath(path), weights_identity(path)]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def page_key(namespace: str, block_hash: int, adapter: str | None = None) -> str:
    """The store key of a page: under the model's ``namespace``, and the ``adapter_namespace``
    of the adapter it was computed under (None: the base model)."""
    if adapter is None:
        return f"pdserve-kv/{namespace}/{block_hash:016x}"
    return f"pdserve-kv/{namespace}/lora-{adapter}/{block_hash:016x}"
