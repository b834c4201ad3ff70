"""The scheduler's own Prometheus families, as a rank sends them (``RankMetrics``).

- ``pdserve_preemptions_total{reason}``: running requests retracted to re-queue, by why:
  ``priority`` (for a waiting request of higher priority, ``--enable-priority-scheduling``) or
  ``memory`` (a decode step lacked pages). Each resumes later by recompute; none is lost.
- ``pdserve_lora_adapter_loads_total{into}``: LoRA adapters loaded, by where: ``host`` (a
  checkpoint read from disk: ``--lora-paths`` at start, ``/load_lora_adapter``) or ``slot`` (its
  weights copied into one of the ``--max-loras-per-batch`` slots a step applies, when a request
  needs an adapter no slot holds). Slot loads per minute are what adapter-aware routing saves.
"""

from __future__ import annotations

from pdserve.engine.messages import MetricFamily, MetricSample


def scheduler_families(num_retractions: int, num_preemptions: int) -> list[MetricFamily]:
    """``num_retractions``: every retraction; ``num_preemptions``: those for priority."""
    name = "pdserve_preemptions"
    counts = {"priority": num_preemptions, "memory": num_retractions - num_preemptions}
    return [MetricFamily(name, "counter", "Running requests retracted to re-queue, by reason.",
                         [MetricSample(name + "_total", {"reason": k}, float(v)) for k, v in counts.items()])]


def lora_families(host_loads: int, slot_loads: int) -> list[MetricFamily]:
    """The adapter loads of a rank since start (0 and 0 without ``--enable-lora``)."""
    name = "pdserve_lora_adapter_loads"
    counts = {"host": host_loads, "slot": slot_loads}
    return [MetricFamily(name, "counter", "LoRA adapters loaded, by where: host memory (from disk) or a slot.",
                         [MetricSample(name + "_total", {"into": k}, float(v)) for k, v in counts.items()])]
