"""Admin routes: POST /cache/flush.

Who may call them: with --admin-api-key, only that key (as `Authorization: Bearer`);
without it, whoever may call the rest of the API (so a server with no keys at all is
open, as every other route is). Flushing drops every cached prefix in every tier (the
pool's, the host memory's, the disk's) that no running request holds; running
requests are unaffected.
"""
from __future__ import annotations

import hmac
import queue
import uuid

from ferroxmp.frontend.errors import ApiError
from ferroxmp.protocol import FlushCache, RowOut

ADMIN_PATHS = ("/cache/flush",)
FLUSH_TIMEOUT_S = 30.0


def check_admin(args: dict, authorization: str) -> None:
    """401 unless `authorization` carries --admin-api-key (only called when it is set)."""
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), args["admin_api_key"].encode()):
        raise ApiError(401, "this route needs the admin key (--admin-api-key) as 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


def flush(bridge) -> dict:
    """Ask the scheduler to flush and wait for its answer."""
    rid = "flush-" + uuid.uuid4().hex[:16]
    try:
        out = bridge.call(FlushCache(rid), rid, FLUSH_TIMEOUT_S)
    except queue.Empty:
        raise ApiError(503, "the scheduler did not answer the flush in time", code="scheduler_unavailable")
    if not isinstance(out, RowOut):
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    return {"object": "cache.flush", "flushed": True}
