"""Pieces of an engine server's front end that ``pdserve serve`` and the offline ``Engine`` share.

Whichever carries the messages to the ranks (scheduler processes over ZMQ, or
one rank on a thread), the front end is a ``TokenizerManager`` and, in
prefill mode, the bootstrap server where the prefill ranks register and decode
ranks look them up. Both are assembled here, once.
"""

from __future__ import annotations

import logging

from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.server_config import ServerConfig

logger = logging.getLogger(__name__)


async def start_bootstrap_server(config: ServerConfig, metrics: ServerMetrics):
    """In prefill mode, start the bootstrap server on the running event loop and return it (its
    ``stop()`` is a coroutine); None in the other modes. The ranks register as they start."""
    if config.disaggregation_mode != "prefill":
        return None
    from pdserve.kvtransfer.bootstrap_server import BootstrapServer

    bootstrap = BootstrapServer(
        config.host, config.kv_transfer.bootstrap_port, dp_size=config.dp_size, tp_size=config.tp_size,
        auth=config.kv_transfer.frame_auth("bootstrap"),
        on_refused=metrics.bootstrap_auth_refused.inc,
    )
    await bootstrap.start()
    logger.info("bootstrap server on %s:%d", config.host, bootstrap.port)
    return bootstrap
