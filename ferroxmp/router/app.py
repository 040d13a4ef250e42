"""The router's Flask app: the OpenAI routes proxied to a backend, plus its own
/health and /metrics.

Invariants: a generation request is sent to at most one backend that it reached
(it moves on only after NotReached or a backend's "shutting_down" refusal); the
client's Authorization header is forwarded unchanged, so backends keep checking
their keys; every error the router itself gives is JSON in OpenAI's shape; a
backend's in-flight count is given back exactly once however the reply ends.
"""
from __future__ import annotations

import hmac
import http.client
import json
import logging

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from ferroxmp.router.keys import routing_text
from ferroxmp.router.metrics import CONTENT_TYPE
from ferroxmp.router.policy import LeastLoaded
from ferroxmp.router.tree import block_ids
from ferroxmp.router.upstream import FORWARDED_REQUEST_HEADERS, NotReached, Relay, response_headers, send

log = logging.getLogger("ferroxmp.router")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 502: "internal_server_error",
          503: "service_unavailable_error"}


class RouterError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": _TYPES.get(self.status, "internal_server_error"),
                          "param": None, "code": self.code}}
        return Response(json.dumps(body), status=self.status, mimetype="application/json")


def _is_shutting_down(status: int, body: bytes) -> bool:
    """A backend draining refuses with 503 code "shutting_down" before doing anything."""
    try:
        return status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    except (ValueError, KeyError, TypeError):
        return False


def create_app(state) -> Flask:
    """`state`: pool (BackendPool), policy, metrics (RouterMetrics), args (RouterArgs)."""
    app = Flask("ferroxmp.router")
    app.config["MAX_CONTENT_LENGTH"] = state.args.max_body_bytes

    @app.before_request
    def _gate():
        key = state.args.api_key
        if key and (request.path.startswith("/v1/") or request.path == "/generate"):
            given = request.headers.get("Authorization", "")
            anthropic = request.headers.get("x-api-key", "")  # the anthropic SDK's header
            if not (hmac.compare_digest(given.encode(), f"Bearer {key}".encode())
                    or hmac.compare_digest(anthropic.encode(), key.encode())):
                raise RouterError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                  "(or 'x-api-key: <key>')", "invalid_api_key")

    @app.errorhandler(RouterError)
    def _router_error(e: RouterError):
        log.warning("%s %s: %d %s", request.method, request.path, e.status, e.message)
        return e.response()

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        message = {404: f"no route {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}",
                   413: f"request body over {state.args.max_body_bytes} bytes"}.get(e.code, e.description)
        return RouterError(e.code or 500, message, e.name.lower().replace(" ", "_")).response()

    def forward(method: str, path: str, body, ids: list[int], policy):
        """(backend, connection, response, refusal) of the first backend that takes the
        request; connection is None and refusal the body read when it answered 503."""
        headers = {k: v for k in FORWARDED_REQUEST_HEADERS if (v := request.headers.get(k)) is not None}
        tried = []
        while True:
            candidates = [b for b in state.pool.healthy() if b not in tried]
            if not candidates:
                raise RouterError(503, f"no healthy backend (tried {len(tried)}; "
                                  f"{len(state.pool.backends)} configured)", "no_backend")
            decision = policy.choose(candidates, ids)
            b = decision.backend
            b.begin()
            # Recorded before sending: the reply's headers wait for the first token, and requests
            # sharing this prefix that arrive meanwhile should follow it (a failed send clears it).
            b.tree.insert(ids)
            try:
                conn, resp = send(b, method, path, body, headers, state.args.upstream_timeout)
            except NotReached as e:
                b.end()
                b.mark_dead(str(e))
                tried.append(b)
                state.metrics.retries.inc()
                log.warning("request for %s did not reach %s (%s); trying another backend", path, b.url, e)
                continue
            except (OSError, http.client.HTTPException) as e:
                b.end()
                state.metrics.upstream_errors.labels(b.url).inc()
                raise RouterError(502, f"backend {b.url} failed before answering: {type(e).__name__}",
                                  "backend_failed") from None
            refusal = None
            if resp.status == 503 and resp.getheader("Content-Type", "").startswith("application/json"):
                refusal = resp.read()
                conn.close()
                if _is_shutting_down(resp.status, refusal):
                    b.end()
                    b.mark_dead("draining")
                    tried.append(b)
                    state.metrics.retries.inc()
                    continue
            state.metrics.routed.labels(b.url).inc()
            if decision.affinity:
                state.metrics.affinity_hits.inc()
            return b, (None if refusal is not None else conn), resp, refusal

    def proxy(method: str, path: str, body, ids: list[int], policy) -> Response:
        b, conn, resp, read = forward(method, path, body, ids, policy)
        headers = response_headers(resp)
        if conn is None:  # already read
            b.end()
            return Response(read, status=resp.status, headers=headers)
        event_stream = resp.getheader("Content-Type", "").startswith("text/event-stream")
        if not event_stream:
            try:
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:
                state.metrics.upstream_errors.labels(b.url).inc()
                raise RouterError(502, f"backend {b.url} failed mid-reply: {type(e).__name__}",
                                  "backend_failed") from None
            finally:
                conn.close()
                b.end()
            return Response(data, status=resp.status, headers=headers)

        def on_close(broken: bool) -> None:
            b.end()
            if broken:
                state.metrics.upstream_errors.labels(b.url).inc()

        return Response(Relay(conn, resp, on_close), status=resp.status, headers=headers)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/generate")
    @app.post("/v1/messages")
    @app.post("/v1/messages/count_tokens")
    @app.post("/v1/responses")
    @app.post("/v1/embeddings")
    def generate():
        body = request.get_data(cache=False)
        ids = block_ids(routing_text(request.path, body), state.args.block_chars)
        return proxy("POST", request.path, body, ids, state.policy)

    @app.get("/v1/responses/<rid>")
    @app.delete("/v1/responses/<rid>")
    def stored_response(rid: str):
        """A stored response lives on the backend that made it: ask each healthy one until
        one knows the id (404 from all: unknown). The store is per backend, so a
        `previous_response_id` reaches its history only when the conversation's prefix
        routes it back there (cache-aware policy), as it does for a growing input."""
        headers = {k: v for k in FORWARDED_REQUEST_HEADERS if (v := request.headers.get(k)) is not None}
        last = None
        for b in state.pool.healthy():
            try:
                conn, resp = send(b, request.method, request.path, None, headers, state.args.health_timeout)
            except (NotReached, OSError, http.client.HTTPException):
                continue
            try:
                data = resp.read()
            finally:
                conn.close()
            last = Response(data, status=resp.status, headers=response_headers(resp))
            if resp.status != 404:
                return last
        if last is None:
            raise RouterError(503, "no healthy backend", "no_backend")
        return last

    @app.get("/v1/models")
    def models():  # any healthy backend knows the model; this must not turn the round-robin wheel
        return proxy("GET", "/v1/models", None, [], LeastLoaded())

    @app.get("/health")
    def health():
        backends = [{"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "load": b.load,
                     "error": b.last_error} for b in state.pool.backends]
        if not any(b["healthy"] for b in backends):
            raise RouterError(503, "no healthy backend", "no_backend")
        return Response(json.dumps({"status": "ok", "policy": state.policy.name, "backends": backends}),
                        mimetype="application/json")

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.render(), mimetype=None, content_type=CONTENT_TYPE)

    return app
