"""``mooncake`` storage backend: Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

The store is a master (``mooncake_master``, which can also serve the HTTP
metadata the transfer engine needs) plus the memory segments that clients
mount: a server contributes ``global_segment_size`` bytes (0: none, it only
reads and writes), and standalone ``mooncake_client`` processes can hold the
pool, so objects outlive the servers that wrote them. Bytes move over the
transfer engine (``protocol`` tcp or rdma).

Extra config (SGLang's HiCache Mooncake keys): ``master_server_address``
(default 127.0.0.1:50051), ``metadata_server`` (default
http://127.0.0.1:8080/metadata), ``local_hostname`` (127.0.0.1), ``protocol``
(tcp), ``device_name`` (RDMA devices, ""), ``global_segment_size`` (bytes this
server contributes, default 0), ``local_buffer_size`` (default 64 MiB).

The raw client returns integer codes; they become ``StorageError`` here.
"""

from __future__ import annotations

from pdserve.engine.mem_cache.storage_backend import StorageBackend, StorageError


class MooncakeStorage(StorageBackend):
    def __init__(self, extra: dict):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError(f"mooncake storage needs the mooncake-transfer-engine wheel: {e}") from None
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            str(extra.get("local_hostname", "127.0.0.1")),
            str(extra.get("metadata_server", "http://127.0.0.1:8080/metadata")),
            int(extra.get("global_segment_size", 0)),
            int(extra.get("local_buffer_size", 64 * 2**20)),
            str(extra.get("protocol", "tcp")),
            str(extra.get("device_name", "")),
            str(extra.get("master_server_address", "127.0.0.1:50051")),
        )
        if rc != 0:
            raise StorageError(f"mooncake store setup failed (rc {rc}): is mooncake_master running at "
                               f"{extra.get('master_server_address', '127.0.0.1:50051')}?")

    def exists(self, keys):
        codes = self.store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise StorageError(f"mooncake batch_is_exist failed (codes {sorted(set(codes))})")
        return [c == 1 for c in codes]

    def get(self, key):
        value = self.store.get(key)
        # an empty result is both "missing" and "master unreachable": ask which
        if not value:
            code = self.store.is_exist(key)
            if code < 0:
                raise StorageError(f"mooncake get {key}: master unreachable (code {code})")
            return None
        return value

    def put(self, key, value):
        rc = self.store.put(key, value)
        # a key another server stored first is refused; that is success here: the first writer wins,
        # and readers check every object (storage_object.py), so a planted one is refused and deleted
        if rc != 0 and self.store.is_exist(key) != 1:
            raise StorageError(f"mooncake put {key} failed (rc {rc})")

    def delete(self, key):
        # force: a get leases the object for a few seconds (and every reader's get renews it), so an
        # ordinary remove of the bad object just read fails; a reader racing this reads bytes the
        # tag check refuses
        rc = self.store.remove(key, force=True)
        if rc != 0 and self.store.is_exist(key) == 1:
            raise StorageError(f"mooncake remove {key} failed (rc {rc})")

    def close(self):
        self.store.close()
