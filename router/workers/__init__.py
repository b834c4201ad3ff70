"""pdserve.router.workers: the worker set: registry, health checks, readiness, drain and prefill/decode pairing."""
