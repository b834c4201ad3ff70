"""Speculative decoding's counters on a rank, and their Prometheus families (``RankMetrics``).

- ``pdserve_spec_proposed_tokens_total`` / ``pdserve_spec_accepted_tokens_total``: draft tokens
  verified and accepted (their ratio is the accept rate).
- ``pdserve_spec_verify_steps_total``: sequence-steps that verified a draft (a batch of 8 speculating
  sequences is 8); ``pdserve_spec_backoff_steps_total``: sequence-steps that decoded plainly because
  the adaptive rule held them back.
- ``pdserve_spec_accept_length``: histogram of the tokens each verify gained (accepted drafts + 1).
- ``pdserve_spec_proposer_seconds_total``: time in the proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.messages import MetricFamily, MetricSample
from pdserve.engine.speculative_names import MAX_DRAFT_TOKENS

# accept length buckets: 1 (only the bonus) .. MAX_DRAFT_TOKENS + 1
ACCEPT_LENGTH_BUCKETS = tuple(range(1, MAX_DRAFT_TOKENS + 2))


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    backoff_steps: int = 0
    proposer_s: float = 0.0
    # accept length -> count (accepted drafts + 1 bonus token)
    lengths: dict[int, int] = field(default_factory=dict)

    def verified(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        self.lengths[accepted + 1] = self.lengths.get(accepted + 1, 0) + 1

    def families(self) -> list[MetricFamily]:
        def counter(name: str, doc: str, value: float) -> MetricFamily:
            return MetricFamily(name, "counter", doc, [MetricSample(name + "_total", {}, float(value))])

        hist = "pdserve_spec_accept_length"
        samples, cum = [], 0
        for le in ACCEPT_LENGTH_BUCKETS:
            cum += self.lengths.get(le, 0)
            samples.append(MetricSample(hist + "_bucket", {"le": str(float(le))}, float(cum)))
        samples.append(MetricSample(hist + "_bucket", {"le": "+Inf"}, float(self.verify_steps)))
        samples.append(MetricSample(hist + "_count", {}, float(self.verify_steps)))
        samples.append(MetricSample(hist + "_sum", {}, float(self.accepted + self.verify_steps)))
        return [
            counter("pdserve_spec_proposed_tokens", "Draft tokens verified.", self.proposed),
            counter("pdserve_spec_accepted_tokens", "Draft tokens accepted.", self.accepted),
            counter("pdserve_spec_verify_steps", "Sequence-steps that verified a draft.", self.verify_steps),
            counter("pdserve_spec_backoff_steps", "Sequence-steps decoded plainly by the adaptive rule.",
                    self.backoff_steps),
            counter("pdserve_spec_proposer_seconds", "Seconds spent proposing drafts.", self.proposer_s),
            MetricFamily(hist, "histogram", "Tokens gained per verify (accepted drafts + 1).", samples),
        ]
