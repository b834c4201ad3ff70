"""Who may call the engine server's control routes, and how.

Control routes change the server or read its weights (``CONTROL_PATHS``: cache flush, weight
update and read, memory release and resume, profiling, expert distribution recording, LoRA
adapter load and unload). They take:

- ``--admin-api-key`` (or its file, or ``PDSERVE_ADMIN_API_KEY``) when one is set, as
  ``Authorization: Bearer KEY`` (what the router sends its workers on the routes it fans out),
  compared in constant time; the inference key never opens them. Without an admin key they
  answer only to loopback peers, and the 403 says so.
- ``POST`` only, with ``Content-Type: application/json``: a web page can send a simple
  cross-origin POST (a form, ``text/plain``) to a server on localhost without a preflight, but
  not a JSON one. GET is a 405, another content type a 415.

Inference routes keep ``--api-key`` (``http_server.api_middleware``).
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pdserve.engine.frontend.request_error import RequestError
from pdserve.engine.net_allowlist import is_loopback_peer

CONTROL_PATHS = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/get_weights_by_name", "/release_memory_occupation",
    "/resume_memory_occupation", "/start_profile", "/stop_profile", "/start_expert_distribution_record",
    "/stop_expert_distribution_record", "/dump_expert_distribution_record", "/load_lora_adapter",
    "/unload_lora_adapter",
})


def _bearer(request: web.Request) -> bytes:
    header = request.headers.get("Authorization", "")
    return header[7:].encode() if header.startswith("Bearer ") else b""


def check_control(request: web.Request, admin_api_key: str | None) -> None:
    """Raise the RequestError (401, 403, 405, 415) that refuses ``request`` to a control route."""
    where = f"{request.method} {request.path}"
    if admin_api_key is not None:
        if not hmac.compare_digest(_bearer(request), admin_api_key.encode()):
            raise RequestError(f"{where} is a control route: it needs 'Authorization: Bearer <--admin-api-key>'",
                               status=401, type="authentication_error", code="invalid_admin_api_key")
    elif not is_loopback_peer(request.remote):
        raise RequestError(f"{where} is a control route and this server has no --admin-api-key: it answers only "
                           f"loopback peers, not {request.remote}", status=403, type="permission_denied",
                           code="admin_loopback_only")
    if request.method != "POST":
        raise RequestError(f"{where}: control routes take POST only", status=405, code="method_not_allowed")
    if request.content_type != "application/json":
        raise RequestError(f"{where}: control routes take Content-Type application/json, not "
                           f"{request.content_type!r}", param="Content-Type", status=415,
                           code="unsupported_media_type")
