"""pdserve.kvtransfer: KV page transfer between prefill and decode ranks.

Scheduler-facing API (all non-blocking, driven by polling from the scheduler loop)::

    # prefill server: one bootstrap server, one manager per scheduler rank
    BootstrapServer(host, port, dp_size).start_in_thread()   # or: await server.start()
    mgr = PrefillKVManager(cfg, pool, bootstrap_port, dp_rank=r).start()
    sender = mgr.create_sender(room)
    sender.poll()                          # Bootstrapping -> WaitingForInput: run the prefill
    sender.send(pages, is_last, aux)       # per chunk; aux (first token, logprobs) with the last
    sender.poll()                          # Transferring -> Success | Failed (sender.failure_reason)

    # decode server: one manager per scheduler rank
    mgr = DecodeKVManager(cfg, pool).start()   # cfg.backend: mooncake, nixl, local (one process)
    r = mgr.create_receiver(room, bootstrap_host, bootstrap_port, prefill_dp_rank)
    r.poll()                               # Bootstrapping -> WaitingForInput
    r.init(dst_pages, mgr.aux_pool.alloc())
    r.poll()                               # Transferring -> Success | Failed; then r.aux()
    mgr.abort(room, reason); mgr.close()

One room, step by step:
1. The decode manager looks up the prefill rank at its bootstrap server (``GET /route``
   through ``bootstrap_client``, cached per rank) and checks page size, dtype and layout.
2. Once per pair it sends ``RegisterPool`` (buffer base addresses, engine peer info);
   the prefill rank validates it and answers ``RegisterAck``.
3. Per room the decode side sends ``RoomRequest`` (page indices and an aux slot only).
4. The prefill side's transfer thread merges page runs contiguous on both sides into one
   descriptor per layer per K/V, writes them (and the aux slot with the last chunk)
   through the engine, then sends ``RoomStatus``; with nixl the last write also carries a
   per-room notification, and the decode side waits for both. Layer-wise
   (``KVTransferConfig.layerwise``): a chunk is queued before its forward with the forward's
   ``LayerSignal`` (``sender.send(pages, False, layers=signal)``) and each layer's descriptors
   are written once the model stored that layer; the aux data follows as its own last chunk.
5. ``AbortRoom`` either way fails the room on both sides; heartbeats from decode to each
   known prefill rank fail every open room of a peer that stops answering.

With ``KVTransferConfig.auth_key_file`` every control frame and bootstrap ``PUT /route`` is
authenticated with the shared secret (``engine/kv_auth.py``); refused frames are counted, never decoded.
"""

import importlib

# name -> submodule (or a full module path: the config in engine/, the engines in engines/); imported on first use (PEP 562), so ``import pdserve.kvtransfer`` stays light
# (no torch, zmq or backend library) and the submodules never import this package back
_EXPORTS = {
    "AuxData": "aux_pool", "AuxPool": "aux_pool",
    "BootstrapServer": "bootstrap_server",
    "DEFAULT_BOOTSTRAP_PORT": "pdserve.engine.kv_transfer_config",
    "KVTransferConfig": "pdserve.engine.kv_transfer_config",
    "DecodeKVManager": "decode_kv_manager",
    "ConnectError": "errors", "EngineInitError": "errors", "KVTransferError": "errors",
    "RegistrationError": "errors", "TransferEngineError": "errors", "TransferFailedError": "errors",
    "KVPoll": "kv_poll",
    "KVReceiver": "kv_receiver",
    "KVSender": "kv_sender",
    "PrefillKVManager": "prefill_kv_manager",
    "TRANSFER_ENGINES": "pdserve.kvtransfer.engines.transfer_engine", "TransferEngine": "pdserve.kvtransfer.engines.transfer_engine", "TransferHandle": "pdserve.kvtransfer.engines.transfer_engine",
    "TransferState": "pdserve.kvtransfer.engines.transfer_engine", "check_transfer_backend": "pdserve.kvtransfer.engines.transfer_engine",
    "create_transfer_engine": "pdserve.kvtransfer.engines.transfer_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = module if "." in module else f"{__name__}.{module}"
    return getattr(importlib.import_module(path), name)
