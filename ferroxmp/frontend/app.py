"""The Flask app: HTTP routes of the OpenAI-compatible API and the native ones.

Invariants: every error response is JSON in OpenAI's shape (never HTML, never a
stack trace) and is logged with its request id; /v1/* and /generate require the
API key when one is set; while draining or after a Shutdown, new generation
requests get 503; every Generation is closed, and the in-flight count given
back, however its response ends (done, error, client gone).
"""
from __future__ import annotations

import itertools
import logging
import os
import uuid
from typing import Optional

import msgspec
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from ferroxmp.frontend import admin, dialect, tokenize_api

from ferroxmp.frontend.anthropic import messages as anthropic_api

from ferroxmp.frontend.openai import embeddings

from ferroxmp.frontend.openai import responses as responses_api

from ferroxmp.frontend.openai import schemas

from ferroxmp.frontend.tools import parse as tool_parse
from ferroxmp.frontend.auth import Keyring, cache_salt
from ferroxmp.frontend.errors import ApiError
from ferroxmp.frontend.fields import decode_body
from ferroxmp.frontend.generation import ClientGone, Generation, StreamBody
from ferroxmp.frontend.metrics import CONTENT_TYPE
from ferroxmp.frontend.text.prompts import PromptEncoder
from ferroxmp.frontend.openai.replies import SSE_DONE, Formatter, sse
from ferroxmp.frontend.state import FrontendState

log = logging.getLogger("ferroxmp.frontend")
_json = msgspec.json.Encoder()
_GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/embeddings", "/v1/messages",
                   "/v1/responses")
_STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The chat page loads only its own files and talks only to this server; even a reply that
# slipped past textContent as markup could not run a script or load anything.
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
             "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def _json_response(obj, status: int = 200) -> Response:
    return Response(_json.encode(obj), status=status, mimetype="application/json")


def _error_response(e: ApiError) -> Response:
    log.warning("request %s: %d %s (param=%s)", getattr(g, "request_id", "-"), e.status, e.message, e.param)
    if request.path.startswith("/v1/messages"):  # Anthropic's clients read Anthropic's error shape
        return _json_response(anthropic_api.error_body(e), e.status)
    return _json_response(e.body(), e.status)


def create_app(state: FrontendState) -> Flask:
    app = Flask("ferroxmp.frontend", static_folder=_STATIC_DIR, static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = int(state.args.get("max_body_bytes") or 8 * 1024 * 1024)
    keyring = Keyring.from_args(state.args)
    encoder = PromptEncoder.for_codec(state.codec, state.max_model_len)
    tool_format = tool_parse.format_for_template(getattr(state.codec, "chat_template", None))
    # With a key, everything needs it but the probe, the chat page's own files and, when
    # asked, the scrape target.
    open_paths = {"/health", "/"} | ({"/metrics"} if state.args.get("metrics_public") else set())

    @app.before_request
    def _gate():
        g.request_id = uuid.uuid4().hex[:24]
        g.tenant = ""
        path = request.path
        if path in admin.ADMIN_PATHS and state.args.get("admin_api_key"):
            admin.check_admin(state.args, request.headers.get("Authorization", ""))
        elif keyring.enabled and path not in open_paths and not path.startswith("/static/"):
            # Anthropic's clients send the key as x-api-key
            api_key = request.headers.get("x-api-key")
            g.tenant = keyring.check(request.headers.get("Authorization", "") or
                                     (f"Bearer {api_key}" if api_key else ""))
        if path in _GENERATE_PATHS and request.method == "POST":
            if state.bridge.dead_reason is not None:
                raise ApiError(503, f"the server is shutting down ({state.bridge.dead_reason})",
                               code="shutting_down")
            if state.draining:
                raise ApiError(503, "server is shutting down; retry on another replica", code="shutting_down")

    @app.after_request
    def _tag(resp: Response):
        resp.headers["X-Request-Id"] = g.get("request_id", "-")
        return resp

    @app.errorhandler(ApiError)
    def _api_error(e: ApiError):
        return _error_response(e)

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        status = e.code or 500
        message = {404: f"no route {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}",
                   413: f"request body over {app.config['MAX_CONTENT_LENGTH']} bytes"}.get(status, e.description)
        return _error_response(ApiError(status, message, code=e.name.lower().replace(" ", "_")))

    @app.errorhandler(Exception)
    def _crash(e: Exception):
        log.exception("request %s: unhandled error", getattr(g, "request_id", "-"))
        return _error_response(ApiError(500, "internal server error", code="internal_error"))

    def body_json():
        return decode_body(request.get_data(cache=False))

    def check_model(model: Optional[str]) -> None:
        if model is not None and model not in (state.model_name, state.args.get("model")):
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{state.model_name}'", param="model", code="model_not_found")

    def run(req: schemas.ApiRequest, prompts: list[list[int]], fmt: Formatter) -> Response:
        params = [req.sampling_for(len(ids), state.max_model_len, state.pool_tokens) for ids in prompts]
        splitter = dialect.reasoning_for(state, prompts[0]) if req.kind == "chat" else None
        dialect.think_first(state, splitter, params[0])
        disconnected = request.environ.get("waitress.client_disconnected") or (lambda: False)
        gen = Generation(bridge=state.bridge, metrics=state.metrics,
                         decode=None if req.kind == "generate" else state.codec.decode,
                         request_id=g.request_id, prompts=prompts, params=params, n=req.n,
                         stops=req.stop, is_disconnected=disconnected,
                         cache_salt=cache_salt(g.tenant, req.cache_salt),
                         reasoning=splitter)
        state.begin()
        body: Optional[StreamBody] = None
        try:
            gen.start()
            deltas = gen.deltas()
            first = next(deltas, None)  # waits: a refusal still gets its own HTTP status
            if req.stream:
                body = StreamBody(state, gen, _events(gen, deltas, first, fmt, req.include_usage))
                return Response(body, mimetype="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            for d in ([first] if first else []) + list(deltas):
                fmt.add(d)
            return _json_response(fmt.body(gen.usage))
        except ClientGone:
            log.info("request %s: client disconnected; aborted", g.request_id)
            return Response(b"", status=499)
        finally:
            if body is None:  # otherwise the streamed body owns the cleanup
                gen.close()
                state.end()

    @app.post("/v1/completions")
    def completions():
        req = schemas.parse_completion(body_json(), state.vocab_size, state.max_model_len)
        check_model(req.model)
        prompts = [encoder.encode(p, "prompt") if isinstance(p, str) else list(p) for p in req.prompts]
        fmt = Formatter("completion", g.request_id, state.model_name, state.codec,
                        top_logprobs=req.sampling.logprobs, n=req.n)
        if req.echo:
            fmt.echo_texts = [p if isinstance(p, str) else state.codec.decode(p) for p in req.prompts]
            fmt.echo_ids = prompts
        return run(req, prompts, fmt)

    @app.post("/v1/chat/completions")
    def chat_completions():
        req = schemas.parse_chat(body_json(), state.vocab_size, state.max_model_len, tool_format)
        check_model(req.model)
        ids, parser = dialect.chat_prompt(req, encoder, tool_format)
        fmt = Formatter("chat", g.request_id, state.model_name, state.codec, top_logprobs=req.sampling.logprobs,
                        n=req.n, tool_parser=parser)
        return run(req, [ids], fmt)

    @app.post("/generate")
    def generate():
        req = schemas.parse_generate(body_json(), state.vocab_size, state.max_model_len)
        check_model(req.model)
        fmt = Formatter("generate", g.request_id, state.model_name, state.codec, top_logprobs=req.sampling.logprobs)
        return run(req, [list(req.prompts[0])], fmt)

    pooling = embeddings.resolve_pooling(state.args.get("model"), state.args.get("pooling") or "auto")

    @app.post("/v1/embeddings")
    def create_embeddings():
        req = embeddings.parse(body_json(), encoder, state.vocab_size, state.max_model_len)
        check_model(req.model)
        disconnected = request.environ.get("waitress.client_disconnected") or (lambda: False)
        gen = Generation(bridge=state.bridge, metrics=state.metrics, decode=None, request_id=g.request_id,
                         prompts=req.inputs, params=[embeddings.params(pooling)] * len(req.inputs),
                         is_disconnected=disconnected, cache_salt=cache_salt(g.tenant, ""))
        state.begin()
        try:
            gen.start()
            for _ in gen.deltas():
                pass
            vectors = [c.embedding for c in gen.choices]
            if not all(vectors):
                raise ApiError(500, "the model worker returned no embedding", code="internal_error")
            return _json_response(embeddings.body(req, vectors, state.model_name, gen.usage))
        except ClientGone:
            return Response(b"", status=499)
        finally:
            gen.close()
            state.end()

    @app.post("/v1/messages")
    def anthropic_messages():
        chat = anthropic_api.to_chat(body_json())
        req = schemas.parse_chat(chat, state.vocab_size, state.max_model_len, tool_format)
        check_model(req.model)
        ids, parser = dialect.chat_prompt(req, encoder, tool_format)
        writer = anthropic_api.MessagesWriter(state.model_name, g.request_id, parser)
        return dialect.serve(state, dialect.generation(state, req, ids), writer, req.stream,
                             anthropic_api.error_body)

    response_store = responses_api.ResponseStore()

    @app.post("/v1/responses")
    def create_response():
        chat, messages, echo = responses_api.to_chat(body_json(), response_store)
        req = schemas.parse_chat(chat, state.vocab_size, state.max_model_len, tool_format)
        check_model(req.model)
        ids, parser = dialect.chat_prompt(req, encoder, tool_format)
        writer = responses_api.ResponsesWriter(state.model_name, g.request_id, parser, echo, messages,
                                               response_store)
        return dialect.serve(state, dialect.generation(state, req, ids), writer, req.stream,
                             responses_api.error_event)

    @app.get("/v1/responses/<response_id>")
    def get_response(response_id: str):
        return _json_response(response_store.get(response_id).body)

    @app.delete("/v1/responses/<response_id>")
    def delete_response(response_id: str):
        response_store.delete(response_id)
        return _json_response(responses_api.deleted(response_id))

    @app.post("/v1/messages/count_tokens")
    def anthropic_count_tokens():
        chat = anthropic_api.to_chat(body_json(), counting=True)
        req = schemas.parse_chat(chat, state.vocab_size, state.max_model_len, tool_format)
        check_model(req.model)
        ids, _ = dialect.chat_prompt(req, encoder, tool_format)
        return _json_response({"input_tokens": len(ids)})

    @app.post("/tokenize")
    def tokenize():
        out, model = tokenize_api.tokenize(body_json(), encoder, state.vocab_size, state.max_model_len)
        check_model(model)
        return _json_response(out)

    @app.post("/detokenize")
    def detokenize():
        out, model = tokenize_api.detokenize(body_json(), state.codec, state.vocab_size)
        check_model(model)
        return _json_response(out)

    @app.get("/v1/models")
    def models():
        return _json_response({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "ferroxmp",
            "root": state.args.get("model"), "max_model_len": state.max_model_len}]})

    @app.get("/health")
    def health():
        if state.bridge.dead_reason is not None:
            raise ApiError(503, f"the server is shutting down ({state.bridge.dead_reason})", code="shutting_down")
        if state.draining:
            raise ApiError(503, "server is shutting down", code="shutting_down")
        if not state.bridge.heartbeat_fresh:
            raise ApiError(503, "no heartbeat from the scheduler", code="scheduler_unavailable")
        return _json_response({"status": "ok"})

    @app.get("/server_info")
    def server_info():
        args = {**state.args, **{k: "***" if state.args.get(k) else None for k in ("api_key", "admin_api_key")}}
        return _json_response({
            "model": state.model_name, "args": args, "worker_info": state.worker_info,
            "in_flight": state.in_flight, "draining": state.draining,
            "processes": {"supervisor": state.pids.get("supervisor"), "frontend": os.getpid(),
                          "scheduler": state.pids.get("scheduler"),
                          "workers": list(state.pids.get("workers") or [])}})

    @app.post("/cache/flush")
    def cache_flush():
        return _json_response(admin.flush(state.bridge))

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.render(), mimetype=None, content_type=CONTENT_TYPE)

    @app.get("/stats")
    def stats():
        """The scheduler's latest Stats heartbeat as JSON, for the chat page's server panel."""
        return _json_response(msgspec.structs.asdict(state.metrics.stats))

    @app.get("/")
    def chat_page():
        resp = app.send_static_file("index.html")
        resp.headers["Content-Security-Policy"] = _PAGE_CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp

    return app


def _events(gen: Generation, deltas, first, fmt: Formatter, include_usage: bool):
    """SSE events, one write per event. A stream that cannot finish (a process died,
    the shutdown grace ended, a bug) ends with an error event, never silently."""
    try:
        for d in itertools.chain([first] if first is not None else [], deltas):
            for chunk in fmt.chunks(d, include_usage):
                yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk(gen.usage))
        yield SSE_DONE
    except ApiError as e:
        log.warning("request %s: stream ended by error %d: %s", gen.request_id, e.status, e.message)
        yield sse(e.body())
        yield SSE_DONE
    except ClientGone:
        log.info("request %s: client disconnected mid-stream; aborted", gen.request_id)
    except Exception:
        log.exception("request %s: stream failed", gen.request_id)
        yield sse(ApiError(500, "internal server error", code="internal_error").body())
        yield SSE_DONE
