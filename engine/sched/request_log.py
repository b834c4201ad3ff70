"""``--log-requests`` (SGLang's flag): one JSON log line per request per server, with its stages.

A rank marks each stage of a request as it happens; when the request ends, one line goes to
the ``pdserve.requests`` logger (at INFO, whatever ``--log-level`` says: the flag asked for it),
for example on a prefill server::

    ... [dp0] INFO pdserve.requests: {"side": "prefill", "rid": "...", "bootstrap_room": 42, ...,
    "stages": [{"stage": "queued", "t": 1764515000.1}, {"stage": "bootstrapped", "t": ...},
    {"stage": "chunk_computed", "chunk": 0, "t": ...}, {"stage": "chunk_sent", "chunk": 0, "t": ...},
    {"stage": "success", "t": ...}, {"stage": "finished", "t": ...}]}

Stages: prefill queued, bootstrapped, chunk_computed and chunk_sent per chunk (the chunk handed to
the transfer threads after its forward pass; its writes returned), success, finished; decode
queued, preallocated, kv_landed, first_token (the prefill's token joined the running batch),
finished; colocated queued, finished. ``t`` is the Unix time (stages are timed on
``time.monotonic`` and shifted once, when the line is written), so the lines of the two sides
join on ``bootstrap_room`` and order across processes of one host. Only TP rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("pdserve.requests")


class RequestLog:
    def __init__(self, side: str, dp_rank: int, enabled: bool):
        self.side = side
        self.dp_rank = dp_rank
        self.enabled = enabled
        self._stages: dict[str, list[dict]] = {}  # rid -> stages so far
        self._rooms: dict[str, object] = {}  # rid -> its KV sender (chunk times are read at the end)
        if enabled:
            logger.setLevel(logging.INFO)

    def mark(self, rid: str, stage: str) -> None:
        if self.enabled:
            self._stages.setdefault(rid, []).append({"stage": stage, "t": time.monotonic()})

    def attach(self, rid: str, sender) -> None:
        """A prefill request's KV sender: its chunks' ``sent_at``/``written_at`` become stages."""
        if self.enabled:
            self._rooms[rid] = sender

    def end(self, req) -> None:
        """``req`` ended (its final output is going out): write its line and forget it."""
        stages = self._stages.pop(req.rid, None)
        sender = self._rooms.pop(req.rid, None)
        if not self.enabled or stages is None:
            return
        if sender is not None:
            chunks = [{"stage": "chunk_computed", "chunk": i, "t": t} for i, t in enumerate(sender.sent_at)]
            chunks += [{"stage": "chunk_sent", "chunk": i, "t": t} for i, t in enumerate(sender.written_at)]
            stages = sorted(stages + chunks, key=lambda s: s["t"])
        stages.append({"stage": "finished", "t": time.monotonic()})
        shift = time.time() - time.monotonic()
        for s in stages:
            s["t"] = round(s["t"] + shift, 6)
        reason = req.finish_reason
        line = {
            "side": self.side,
            "rid": req.rid,
            "bootstrap_room": req.bootstrap.room if req.bootstrap is not None else None,
            "dp_rank": self.dp_rank,
            "finish_reason": reason.type if reason is not None else None,
            "error": reason.message if reason is not None else None,
            "prompt_tokens": req.prompt_len,
            "output_tokens": len(req.output_ids),
            "stages": stages,
        }
        logger.info("%s", json.dumps(line))
