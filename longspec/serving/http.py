"""The HTTP side of ``longspec serve`` (FastAPI): endpoints, limits and errors over a
:class:`~longspec.serving.server.Server`.

What a client can count on (docs/server-security.md says it for users):

* every error, whatever its status (400, 401, 404, 405, 413, 429, 500), is an OpenAI error
  object ``{"error": {"message", "type", "param", "code"}}``; a 429 carries ``Retry-After``;
* with API keys (``--api-key`` / ``LONGSPEC_API_KEY``) every route but ``/health`` (the API and
  its description, ``/docs``, ``/openapi.json``) needs ``Authorization: Bearer KEY`` with one of
  them, checked before the body is read; each key is a
  tenant whose requests share cached prompt blocks only with its own (and, with a request's
  ``cache_salt``, only with requests of the same salt); ``/health`` stays open for load balancers,
  without the per-request counters unless it is asked with a key;
* a body over ``max_body`` bytes is refused (413) as soon as that many bytes arrived;
* the body is parsed and the prompt tokenised on a worker thread, never on the event loop, so
  one huge prompt delays neither ``/health`` nor the running streams;
* a client that goes away (streamed or not) frees its row within about ``POLL_S`` seconds."""

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .server import APIError, Request, Server

POLL_S = 0.5  # seconds between checks that a waiting client is still connected
DEFAULT_MAX_BODY = 8 << 20  # bytes
RETRY_AFTER_S = 1
DISCARD_FACTOR = 8  # a body over the limit is read (and dropped) up to this many limits before the 413
KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, code: Optional[str] = None) -> dict:
    """An OpenAI error object for ``status``."""
    return APIError(status, message, code=code, kind=KINDS.get(status, "server_error")).body()


def tenant_of(api_keys: list, authorization: bytes) -> Optional[int]:
    """The index of the key an ``Authorization`` header carries (compared with every key in
    constant time), or None."""
    scheme, _, given = authorization.partition(b" ")
    found = None
    for i, key in enumerate(api_keys):
        if hmac.compare_digest(given, key.encode()) and scheme.lower() == b"bearer":
            found = i
    return found


class Guard:
    """ASGI middleware in front of the application: the API keys (before anything is read; the
    key's index, its tenant, goes to the scope's ``longspec.tenant``) and the body limit (the declared
    ``Content-Length`` at once, the bytes as they arrive)."""

    def __init__(self, app, max_body: int, api_keys: list):
        self.app, self.max_body, self.api_keys = app, max_body, list(api_keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_keys:
            tenant = tenant_of(self.api_keys, headers.get(b"authorization", b""))
            scope["longspec.tenant"] = tenant
            if tenant is None and scope["path"] != "/health":  # (the API and its docs: /docs, /openapi.json)
                return await self._reply(scope, receive, send, 401, "a valid API key is needed: "
                                         "send 'Authorization: Bearer KEY'", "invalid_api_key",
                                         {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._discard(receive, 0)
            return await self._reply(scope, receive, send, 413, self._too_large(), "request_too_large",
                                     {"Connection": "close"})
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    if message.get("more_body"):
                        await self._discard(receive, received)
                    raise APIError(413, self._too_large(), code="request_too_large")
            return message

        await self.app(scope, limited, send)

    async def _discard(self, receive, received: int) -> None:
        """Reads and drops the rest of a body that is too large (up to ``DISCARD_FACTOR`` times the
        limit: beyond that the connection is closed), so that the client, still sending, reads
        the 413 instead of a reset connection. Holds one chunk at a time."""
        while received <= DISCARD_FACTOR * self.max_body:
            message = await receive()
            received += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    def _too_large(self) -> str:
        return f"the request body is larger than this server takes ({self.max_body} bytes, --max-body)"

    @staticmethod
    async def _reply(scope, receive, send, status: int, message: str, code: str, headers: dict):
        from starlette.responses import JSONResponse

        await JSONResponse(error_body(status, message, code), status_code=status, headers=headers)(scope, receive, send)


def create_app(server: Server, api_keys=(), max_body: int = DEFAULT_MAX_BODY):
    """The FastAPI application serving ``server`` (see the module docstring); ``api_keys``: the
    keys a client may send (none: no key needed)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    parser = ThreadPoolExecutor(1, thread_name_prefix="longspec-parse")  # one tokenizer user at a time

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        server.stop()  # (shutdown)
        parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="longspec", description="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.add_middleware(Guard, max_body=max_body, api_keys=api_keys)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_, err: Exception):
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), status_code=500)

    @app.get("/health")
    async def health(http: HTTPRequest):
        if server.worker.failure is not None:  # (load balancers: take this server out)
            return JSONResponse({"status": "failed", **error_body(503, server.worker.failure)}, status_code=503)
        stats = server.worker.stats()
        if api_keys and http.scope.get("longspec.tenant") is None:
            # liveness and capacity only: counters that move with each request (the cache's
            # prompt tokens) would tell one tenant another's prompt lengths
            return {"status": "ok", **{k: stats[k] for k in ("active", "waiting", "free_rows")}}
        return {"status": "ok", **stats, "tokenizer_cache": server.pieces.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "longspec"}]}

    async def handle(http: HTTPRequest, chat: bool):
        received = time.perf_counter()
        raw = await http.body()
        loop = asyncio.get_running_loop()
        tenant = http.scope.get("longspec.tenant")
        server.worker.take_for_parsing()  # (a 429 now, before any parsing, where the queue is full)
        parsed = False
        try:
            seq, stop, stream = await loop.run_in_executor(parser, server.parse, raw, chat, tenant)
            parsed = True
        finally:
            server.worker.parsing_done(parsed)
        request = Request(seq, stop, loop, asyncio.Queue(), received=received)
        server.worker.submit(request)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        if stream:
            return StreamingResponse(_events(server, request, ident, kind, chat, http),
                                     media_type="text/event-stream")
        try:
            reason = await _drain(server, request, http)
        except asyncio.CancelledError:
            server.worker.cancel(request)
            raise
        if reason is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        choice = ({"index": 0, "message": {"role": "assistant", "content": request.text}, "finish_reason": reason}
                  if chat else {"index": 0, "text": request.text, "logprobs": None, "finish_reason": reason})
        return {"id": ident, "object": kind, "created": int(request.created), "model": server.model_name,
                "choices": [choice], "usage": _usage(request), "longspec": _extension(request)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await handle(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await handle(http, chat=True)

    return app


async def _next_event(server: Server, request: Request, http):
    """The request's next event, or None once its client has gone away (the request is then
    cancelled: its row is free for the next round). The connection is checked every ``POLL_S``
    seconds, whether events arrive meanwhile or not."""
    loop = asyncio.get_running_loop()
    while True:
        if loop.time() - request.checked >= POLL_S:
            request.checked = loop.time()
            if await http.is_disconnected():
                server.worker.cancel(request)
                return None
        try:
            return await asyncio.wait_for(request.events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
            continue


async def _drain(server: Server, request: Request, http) -> Optional[str]:
    """Waits for a non-streamed request's end; returns its finish reason (None: client gone)."""
    while True:
        event = await _next_event(server, request, http)
        if event is None:
            return None
        kind, value = event
        if kind == "done":
            return value
        if kind == "error":
            raise value


async def _events(server: Server, request: Request, ident: str, kind: str, chat: bool, http):
    """Server-sent events of a streamed request, ``[DONE]`` last (after an error event too); a
    client that goes away cancels it."""
    chunk_kind = "chat.completion.chunk" if chat else kind

    def chunk(text: Optional[str], reason: Optional[str], first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        payload = {"id": ident, "object": chunk_kind, "created": int(request.created), "model": server.model_name,
                   "choices": [choice]}
        if reason is not None:
            payload.update(usage=_usage(request), longspec=_extension(request))
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            event = await _next_event(server, request, http)
            if event is None:
                return
            kind_, value = event
            if kind_ == "text":
                if not request.first_sent:
                    request.first_sent = time.perf_counter()
                yield chunk(value, None)
                continue
            yield chunk(None, value) if kind_ == "done" else f"data: {json.dumps(value.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if request.finish_reason is None and not request.seq.done:
            server.worker.cancel(request)


def _usage(request: Request) -> dict:
    prompt, completion = len(request.seq.prompt), len(request.seq.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": request.seq.cached_tokens}}


def _extension(request: Request) -> dict:
    return {"tau": round(request.seq.tau, 4), "token_ids": list(request.seq.tokens),
            "timings_ms": request.timings_ms()}
