"""Tenants at the router: who a request belongs to, their fair share of the queue (deficit
round-robin by tokens), their rate and concurrency limits, and TTFT-SLO-aware admission."""
