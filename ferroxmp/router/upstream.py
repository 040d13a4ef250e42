"""One proxied exchange with a backend, and the relay of its body to the client.

`send` raises NotReached when the request cannot have reached the backend:
the connection was refused, timed out or reset before the request was fully
written (a server acts on a request only once it has all of it). Only then is
a retry on another backend safe; a failure after that may have started a
generation, so it is the client's error, not a retry.

`Relay` passes a backend's event stream through unchanged, reading small pieces
as they arrive and forwarding them in whole events (up to a blank line), so
that if the backend dies mid-stream the client gets every complete event, then
one error event in OpenAI's shape and `data: [DONE]`, never half an event.
"""
from __future__ import annotations

import http.client
import json
import logging
from typing import Callable

log = logging.getLogger("ferroxmp.router")

READ_BYTES = 16384
# Headers that describe one hop, not the message: never copied between client and backend.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "content-length", "server", "date"}
# x-api-key and anthropic-version: what the anthropic SDK sends on /v1/messages.
FORWARDED_REQUEST_HEADERS = ("Content-Type", "Authorization", "Accept", "x-api-key", "anthropic-version")
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # the blank line that ends an SSE event, as the spec allows


class NotReached(Exception):
    """The request never reached the backend: safe to send elsewhere."""


def send(backend, method: str, path: str, body: bytes, headers: dict, timeout: float):
    """Open a connection, send the request, return (connection, response)."""
    conn = backend.connection(timeout)
    try:
        conn.connect()
    except OSError as e:
        conn.close()
        raise NotReached(f"connect: {type(e).__name__}: {e}") from None
    try:
        conn.request(method, backend.prefix + path, body=body, headers=headers)
    except OSError as e:  # reset or broken pipe while writing: the server has no whole request
        conn.close()
        raise NotReached(f"send: {type(e).__name__}: {e}") from None
    try:
        return conn, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def response_headers(resp: http.client.HTTPResponse) -> list[tuple[str, str]]:
    return [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None,
                      "code": "backend_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class Relay:
    """The body of a streamed reply; `close()` (which WSGI servers always call, even when
    iteration never started) closes the backend connection and calls `on_close(broken)` once:
    broken is True only when the backend failed, not when the client went away."""

    def __init__(self, conn, resp, on_close: Callable[[bool], None]):
        self.conn, self.resp, self.on_close = conn, resp, on_close
        self.broken = False
        self._closed = False

    def __iter__(self):
        pending = b""
        try:
            while piece := self.resp.read1(READ_BYTES):
                pending += piece
                ends = [i + len(sep) for sep in _EVENT_ENDS if (i := pending.rfind(sep)) >= 0]
                if ends:
                    out, pending = pending[:max(ends)], pending[max(ends):]
                    yield out
            if pending:
                yield pending  # a clean end of the body: whatever came is the body
        except (OSError, http.client.HTTPException) as e:
            self.broken = True
            log.warning("backend stream broke: %s: %s", type(e).__name__, e)
            yield error_event(f"the backend failed mid-stream ({type(e).__name__}); the reply is incomplete")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.conn.close()
        self.on_close(self.broken)
