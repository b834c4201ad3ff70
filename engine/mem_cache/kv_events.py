"""KV cache events: what a rank's prefix cache stored, removed or cleared.

The types and their msgpack layout are those of vLLM's
``vllm/distributed/kv_events.py`` (SGLang publishes the same), so a consumer
written for either (NVIDIA Dynamo's KV router, vLLM's example subscriber) reads
pdserve's events: msgspec structs encoded as arrays, each event tagged with its
class name (``["BlockStored", [hashes], parent, [tokens], block_size, lora_id,
medium]``), a batch being ``[ts, [events...], data_parallel_rank]``.

A block is one page (``page_size`` tokens). Its hash is chained: it covers the
block's tokens and its parent's hash, so one hash names a whole prefix, and the
router computes the same hashes from a prompt with ``block_hashes``.

Pure: no sockets. The radix cache appends events to a list; the scheduler
process drains it into a publisher (``pdserve.engine.mem_cache.kv_event_publisher``).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence, Union

import msgspec

# The tier a block lives in, in vLLM's spellings (``vllm/distributed/kv_events.py``): the KV
# pool is "GPU" on every device (the tier the scheduler admits against, as vLLM's block pool;
# consumers such as Dynamo read "GPU" as the primary tier), host memory (L2) "CPU", and the
# store shared by the servers (L3) "STORAGE". Consumers that also read SGLang's HiCache
# spellings (CPU_TIER1, CPU_TIER2) map both to the same tiers (router/kv/kv_tiers.py).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# hashes are kept below 2**63 so that both signed and unsigned 64-bit consumers decode them
_HASH_MASK = (1 << 63) - 1
_ROOT_SEED = b"pdserve-kv-root\0"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name, as vLLM writes it."""


class BlockStored(KVCacheEvent):
    """``block_hashes`` (a chain: each block's parent is the one before, the first's
    ``parent_block_hash``) now live in tier ``medium``."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block hangs off the root
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """``block_hashes`` left tier ``medium`` (they may still live in another tier)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The rank's own tiers (pool and host memory) are empty; the shared store is not its own."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained hash of one block: its tokens and its parent's hash (None at the root)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT_SEED if parent is None else parent.to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big") & _HASH_MASK


#: an adapter's prefix-cache salt is ``ADAPTER_SALT_BASE - lora_id``, put before the tokens of
#: its first block (mem_cache/radix_cache.py keys pages so): above every vocabulary, a uint32
ADAPTER_SALT_BASE = 2**32


def block_hashes(token_ids: Sequence[int], block_size: int, lora_id: int = 0) -> list[int]:
    """The chained hashes of every full block of ``token_ids`` (the partial tail has none), as
    a worker's radix cache hashes them under adapter ``lora_id`` (0: the base model)."""
    out: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        if lora_id and i == 0:
            block = (ADAPTER_SALT_BASE - lora_id, *block)
        parent = block_hash(parent, block)
        out.append(parent)
    return out


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (or ``ValidationError``) on a malformed payload."""
    return _DECODER.decode(payload)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
