"""pdserve.router: the public endpoint that pairs each request with a prefill and a decode worker.

Public API:
- ``RouterConfig`` / ``WorkerSpec`` (``config.py``): the one frozen config; the CLI's defaults.
- ``cli.main(argv=None)``: ``pdserve router`` / ``python -m pdserve.router``.
- ``server.Router(config)``, ``server.start_router(config) -> (router, runner, port)``,
  ``server.serve(config)``: embed or run the router.
- ``policy.Policy``, ``policy.POLICIES`` / ``make_policy(name, config)``: routing policies by name
  (implementations in ``simple_policies.py`` and ``kv/``).

Subpackages: ``kv/`` (KV-aware routing), ``migration/`` (moving a stream mid-flight),
``workers/`` (registry, health, readiness, drain, pairing).
"""
