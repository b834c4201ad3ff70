"""``kv_aware``: routing on the workers' own KV events, for prefill and decode workers alike.

The policy subscribes to every worker of its role (the endpoints come from the
worker's ``/server_info``, ``kv_events_endpoints``), keeps one ``KVIndex`` of
block hash -> endpoints per tier, tokenizes each prompt as the workers do (the
same tokenizer and chat template, loaded from the model's files: the
``--tokenizer-path`` flag, else the workers' ``model_path``, else the default
model) and hashes its full pages the way the workers' radix caches do (in the
namespace of the request's LoRA adapter, ``RouteQuery.lora_id``, so a worker is
credited only with the blocks computed under that adapter).

Choice, after NVIDIA Dynamo's KV router cost (lower wins)::

    cost(e) = overlap_weight * uncached_blocks(e) + load(e) * avg_uncached_blocks
    uncached_blocks(e) = blocks - sum over e's leading cached blocks of weight(tier)

A block in ``e``'s pool saves all of its compute (weight 1), one in its host
memory all but a copy (``--kv-host-cache-hit-weight``), one in the store shared
by every worker all but a fetch (``--kv-storage-cache-hit-weight``; it counts
for every worker, so it narrows the lead of a worker that holds the prefix
itself); ``router/kv/kv_tiers.py`` reads the tiers, docs/ROUTER.md says why these
weights. ``load(e) * avg_uncached_blocks`` estimates the work queued on ``e``
(requests in flight times the mean uncached blocks of routed requests). Dynamo
adds the worker's active decode blocks (memory pressure); a prefill worker
holds none once its KV has left, so that term is absent here. The weight is
1.0, Dynamo's default, and here it has a reason: both terms count blocks of
prefill compute ahead of this request's first token, so their sum estimates
its TTFT in one unit. Ties go to the endpoint with less load, then fewer cached
blocks (the most room), so new prefix groups spread across workers.

As the decode policy (``--decode-policy kv_aware``) the same cost picks the
decode worker whose prefix cache holds the most of the prompt: a decode server
keeps each finished sequence (prompt and answer) in its cache and tells the
prefill how many leading pages it holds, so the next turn of a conversation,
routed back to it, crosses from the prefill with its new pages only.

Until a worker's events and the tokenizer are known, or for a prompt it cannot
tokenize (a batch), the policy falls back to ``cache_aware`` (text only).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from typing import Sequence

from pdserve.engine.mem_cache.kv_events import block_hashes
from pdserve.router.kv.cache_aware_policy import CacheAwarePolicy
from pdserve.router.config import RouterConfig
from pdserve.router.kv.kv_index import KVIndex
from pdserve.router.kv.kv_tiers import Tier, TierWeights, tier_credit
from pdserve.router.kv.kv_subscriber import EventSource, KVEventSubscriber
from pdserve.router.policy import C, Policy
from pdserve.router.route import RouteQuery, prompt_ids

log = logging.getLogger("pdserve.router.kv_aware")

_DEFAULTS = RouterConfig()
DISCOVERY_RETRY_S = 5.0  # a worker whose /server_info did not answer is asked again after this
_EMA = 0.1  # weight of the newest request in the mean uncached blocks
# how long a routed prompt's blocks count as on its worker before its stored event confirms them:
# longer than a long prefill queued on a loaded CPU worker (seconds), short enough that a request
# that failed before caching anything stops attracting its group soon
PREDICTION_TTL_S = 30.0


def kv_cost(uncached_blocks: int, load: int, avg_uncached_blocks: float, overlap_weight: float) -> float:
    return overlap_weight * uncached_blocks + load * avg_uncached_blocks


def choose_by_overlap(endpoints: Sequence[C], overlaps: dict[str, float], num_blocks: int,
                      avg_uncached_blocks: float, overlap_weight: float, cached: dict[str, int]) -> C:
    """The endpoint of lowest ``kv_cost``, ``overlaps`` being each one's credited blocks
    (``tier_credit``); ties: less load, then fewer cached blocks, then order."""
    def rank(ie):
        i, e = ie
        cost = kv_cost(num_blocks - overlaps.get(e.key, 0), e.load, avg_uncached_blocks, overlap_weight)
        return cost, e.load, cached.get(e.key, 0), i

    return min(enumerate(endpoints), key=rank)[1]


class KVAwarePolicy(Policy):
    needs_text = True  # for the cache_aware fallback
    tokenizes = True
    scores_dp_ranks = True  # each DP rank's own blocks (its KV events carry the rank)

    def __init__(self, config: RouterConfig = _DEFAULTS):
        self.config = config
        self.overlap_weight = config.kv_overlap_score_weight
        self.weights = TierWeights(config.kv_host_cache_hit_weight, config.kv_storage_cache_hit_weight)
        self.fallback = CacheAwarePolicy.from_config(config)
        self.lock = threading.Lock()
        self.index = KVIndex()
        self.subscriber = KVEventSubscriber(self.index, self.lock, config.kv_events_timeout_secs)
        self.avg_uncached_blocks = 1.0
        self.routed = {"kv_routed": 0, "fallback": 0}
        self._tokenizer = None
        self._tokenizer_failed = False  # it could not be loaded: routing by cache_aware, logged
        self._tokenizer_lock = threading.Lock()  # discovery threads of several workers race to load it
        self._page_size: int | None = None
        self._asked: dict[str, float] = {}  # worker url -> when its /server_info was last asked
        self._subscribed: set[str] = set()  # worker urls whose event endpoints are known
        self._silent: set[str] = set()  # worker urls that said they publish no events

    @classmethod
    def from_config(cls, config: RouterConfig) -> KVAwarePolicy:
        return cls(config)

    # ----------------------------------------------------------------- choice
    def select(self, endpoints, text):
        self.routed["fallback"] += 1
        return self.fallback.select(endpoints, text)

    @property
    def encoder(self):
        """Its tokenizer's reading of a prompt, once a worker's page size is known (a prompt of
        token ids needs no tokenizer, so this answers even when the tokenizer failed to load)."""
        return None if self._page_size is None else self._encode

    def _encode(self, body: dict) -> list[int] | None:
        try:
            return prompt_ids(self._tokenizer, body)
        except Exception as e:  # noqa: BLE001 - a template error: the worker will say so, route anyway
            log.debug("cannot tokenize the prompt for kv routing: %s", e)
            return None

    def uncached_on(self, query: RouteQuery, endpoint):
        """The prompt less the leading blocks ``endpoint`` holds (or was sent) in its pool or host
        memory, by its own KV events (both are loaded when the prompt is matched; the store's
        pages only if prefetched in time, so not counted); the whole prompt while its events are
        unknown (a decode worker started without ``--kv-events-config``)."""
        self._discover([endpoint])
        ids = query.ids
        if ids is None or self._page_size is None or endpoint.worker.url not in self._subscribed:
            return query.prompt_tokens
        hashes = block_hashes(ids, self._page_size, query.lora_id)
        with self.lock:
            tiers = self.index.block_tiers(hashes, [endpoint.key], time.monotonic())[endpoint.key]
        held = next((i for i, t in enumerate(tiers) if t > Tier.HOST), len(tiers))
        return len(ids) - held * self._page_size

    def prepare(self, endpoints):
        self._discover(endpoints)

    @property
    def ready(self):
        return self._tokenizer is not None or self._tokenizer_failed

    def predict_on(self, query: RouteQuery, endpoint):
        if query.ids is None or self._page_size is None or endpoint.worker.url not in self._subscribed:
            return
        with self.lock:
            self.index.predict(endpoint.key, block_hashes(query.ids, self._page_size, query.lora_id),
                               time.monotonic() + PREDICTION_TTL_S)

    def pick(self, endpoints, query: RouteQuery):
        self._discover(endpoints)
        ids, text = query.ids, query.text
        if ids is None or self._page_size is None or not any(e.worker.url in self._subscribed for e in endpoints):
            return self.select(endpoints, text)
        hashes = block_hashes(ids, self._page_size, query.lora_id)
        keys = [e.key for e in endpoints]
        now = time.monotonic()
        with self.lock:
            tiers = self.index.block_tiers(hashes, keys, now)
            cached = {k: self.index.num_blocks(k) for k in keys}
            overlaps = {k: tier_credit(t, self.weights) for k, t in tiers.items()}
            chosen = choose_by_overlap(endpoints, overlaps, len(hashes), self.avg_uncached_blocks,
                                       self.overlap_weight, cached)
            self.index.predict(chosen.key, hashes, now + PREDICTION_TTL_S)
        uncached = len(hashes) - overlaps[chosen.key]
        self.avg_uncached_blocks += _EMA * (uncached - self.avg_uncached_blocks)
        self.routed["kv_routed"] += 1
        log.debug("kv_aware: %d blocks, overlap %s -> %s", len(hashes), overlaps, chosen.key)
        if text:
            self.fallback.tree.insert(text, chosen.key)  # the fallback stays warm
        return chosen

    def counts(self):
        return {**self.routed, **self.subscriber.counts, "unknown_medium": self.index.unknown_media}

    def close(self):
        self.subscriber.close()

    def forget(self, key):
        self.fallback.forget(key)
        self.subscriber.remove(key)
        url = key.split("@")[0]
        self._subscribed.discard(url)
        self._silent.discard(url)
        self._asked.pop(url, None)

    # -------------------------------------------------------------- discovery
    def _discover(self, endpoints) -> None:
        now = time.monotonic()
        for e in endpoints:
            w = e.worker
            if w.url in self._subscribed or now - self._asked.get(w.url, -DISCOVERY_RETRY_S) < DISCOVERY_RETRY_S:
                continue
            self._asked[w.url] = now
            keys = {(ep.dp_rank or 0): ep.key for ep in w.endpoints}
            threading.Thread(target=self._fetch_info, args=(w.url, keys), daemon=True,
                             name="pdserve-kv-discovery").start()

    def _fetch_info(self, url: str, keys: dict[int, str]) -> None:
        """On a thread of its own: the worker's event endpoints (and, once, the tokenizer)."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        try:
            req = urllib.request.Request(url + "/server_info", headers=headers)
            with urllib.request.urlopen(req, timeout=self.config.health_check_timeout_secs) as resp:
                info = json.loads(resp.read())
        except (OSError, ValueError) as e:
            log.info("kv_aware: %s/server_info: %s (asked again later)", url, e)
            return
        # the tokenizer even without events: local prefill decisions count the prompt's tokens
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._load_tokenizer(self.config.tokenizer_path or info.get("tokenizer_path") or info.get("model_path"))
        self._page_size = int(info.get("page_size") or 1)
        sources = info.get("kv_events_endpoints") or []
        if not sources:
            # asked again every DISCOVERY_RETRY_S (it may restart with events): warned once
            say = log.debug if url in self._silent else log.warning
            say("kv_aware: %s publishes no KV events (start it with --kv-events-config); routing to "
                "it by cache_aware, or counting its whole prompt for a local prefill", url)
            self._silent.add(url)
            return
        for src in sources:
            key = keys.get(int(src.get("dp_rank", 0)))
            if key is not None:
                self.subscriber.add(EventSource(key, src["endpoint"], src.get("replay_endpoint"),
                                                src.get("topic") or ""))
        self._subscribed.add(url)

    def _load_tokenizer(self, model_path: str | None) -> None:
        from pdserve.engine.text.tokenizer import load_tokenizer

        t0 = time.monotonic()
        try:
            self._tokenizer = load_tokenizer(model_path)
        except Exception as e:  # noqa: BLE001 - routing falls back to cache_aware; retried with the next worker
            self._tokenizer_failed = True
            log.error("kv_aware: cannot load the tokenizer of %s (%s: %s): routing by cache_aware "
                      "(--tokenizer-path names the workers' tokenizer)", model_path or "the default model",
                      type(e).__name__, e)
            return
        log.info("kv_aware: tokenizer of %s loaded in %.1f s", model_path or "the default model",
                 time.monotonic() - t0)
