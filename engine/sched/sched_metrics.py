"""The scheduler's own Prometheus families, as a rank sends them (``RankMetrics``).

- ``pdserve_preemptions_total{reason}``: running requests retracted to re-queue, by why:
  ``priority`` (for a waiting request of higher priority, ``--enable-priority-scheduling``) or
  ``memory`` (a decode step lacked pages). Each resumes later by recompute; none is lost.
"""

from __future__ import annotations

from pdserve.engine.messages import MetricFamily, MetricSample


def scheduler_families(num_retractions: int, num_preemptions: int) -> list[MetricFamily]:
    """``num_retractions``: every retraction; ``num_preemptions``: those for priority."""
    name = "pdserve_preemptions"
    counts = {"priority": num_preemptions, "memory": num_retractions - num_preemptions}
    return [MetricFamily(name, "counter", "Running requests retracted to re-queue, by reason.",
                         [MetricSample(name + "_total", {"reason": k}, float(v)) for k, v in counts.items()])]
