"""Layer-wise send: the hand-off of one prefill forward's layers from the compute thread to the
transfer threads (``--disaggregation-layerwise``).

The model calls ``LayerSignal.layer_done(i)`` once layer ``i`` has stored its K and V; a transfer
thread holding a chunk of that step (``PrefillKVManager``) writes the layer's pages at once, so
layer ``i + 1`` computes while layer ``i`` moves and only the last layer's transfer (and the aux
data) is left after the forward.

Why no lock on the compute thread: a step's progress is one int, ``done``, written only by the
compute thread (a single attribute store, atomic under the GIL) and only read by the transfer
threads, which re-read it after every wake-up. The wake-up is a ``Doorbell`` per transfer thread,
an eventfd made once per KV manager: ringing it is one write(2) (about a microsecond, against the
milliseconds a layer computes) that never waits for a consumer. A ``threading.Event`` or
``Condition`` would take a lock per layer on the compute thread, which can wait there while a
transfer thread holds it; a transfer thread spinning on ``done`` instead would take a core from
the compute (this project's CPU hosts have 2).

On CUDA the KV of layer ``i`` is complete only once the compute stream reaches it:
``layer_done`` records one ``torch.cuda.Event`` per layer on the current stream (never blocking
it), and the transfer thread synchronizes on that event (a host-side wait) before it writes.
"""

from __future__ import annotations

import os
import select
import threading

import torch

_WAIT_SLICE_S = 0.1  # a waiting transfer thread re-checks its stop flag this often


class Doorbell:
    """An eventfd one transfer thread sleeps on; any thread rings it without blocking."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def ring(self) -> None:
        fd = self.fd
        if fd >= 0:  # closed with its manager: a forward still running rings nothing (no reused fd)
            os.eventfd_write(fd, 1)

    def wait(self, timeout: float) -> None:
        """Sleep until rung (or ``timeout``); clears the rings so far."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass  # one reader per bell: only a spurious wake-up gets here

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class LayerSignal:
    """One prefill forward's progress over ``num_layers`` layers.

    A context manager around the forward: it yields ``layer_done`` (the model's per-layer hook),
    and on exit marks the step ``ended``; a forward that raised leaves ``done < num_layers``, so
    its waiting transfer threads fail their rooms instead of waiting for layers that never come.
    """

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.done = 0  # layers whose KV is stored (queued on the stream, on CUDA)
        self.ended = False
        self._bells: list[Doorbell] = []
        self._events = [torch.cuda.Event() for _ in range(num_layers)] if device.type == "cuda" else None

    def ring_on(self, bell: Doorbell) -> None:
        """Wake ``bell`` at every layer (scheduler thread, before the forward starts)."""
        if bell not in self._bells:
            self._bells.append(bell)

    @property
    def watched(self) -> bool:
        return bool(self._bells)

    def layer_done(self, layer: int) -> None:
        """Compute thread: layer ``layer`` stored its KV for every token of the step."""
        if self._events is not None:
            self._events[layer].record()
        self.done = layer + 1
        for bell in self._bells:
            bell.ring()

    def __enter__(self):
        return self.layer_done

    def __exit__(self, *exc) -> None:
        self.ended = True
        for bell in self._bells:
            bell.ring()

    def wait_past(self, seen: int, bell: Doorbell, stop: threading.Event) -> int:
        """Transfer thread: block until more than ``seen`` layers are done, or the forward ended
        (or ``stop``); returns the layers done, their KV ready to read."""
        while True:
            if self.ended or stop.is_set():
                done = self.done  # read after ``ended``: the forward's last store is in it
                break
            done = self.done
            if done > seen:
                break
            bell.wait(_WAIT_SLICE_S)
        if self._events is not None:
            for event in self._events[seen:done]:
                event.synchronize()
        return done
