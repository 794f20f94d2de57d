"""The HTTP side of `edgespec serve` (Starlette): OpenAI's routes, the key check, the body limit,
server-sent events. Every request body is validated by the schema `edgespec batch` uses
(`frontends.schema`); every answer carries batch's `speculative` object. Nothing here touches
llama.cpp's contexts: requests go to the engine's thread (`worker`) and come back through a
`Sink`. A bad request gets a 4xx in OpenAI's error shape; no request ends the server."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batch.requests import Defaults, Request
from ..schema import CHAT_URL, TEXT_URL, RequestError
from .worker import Sink, Worker


def check_grammar(engine, grammar: str | None) -> None:
    """A grammar llama.cpp cannot parse (or the vocabulary cannot spell) is the request's 400."""
    if grammar is None:
        return
    from ...rows import Grammar, GrammarError

    try:
        Grammar(engine.target, grammar).close()
    except GrammarError as e:
        raise RequestError(str(e), "invalid_grammar") from None

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024  # bytes of a request body (a prompt that fills a 32k context is ~130 kB)


def error_body(message: str, code: str, status: int) -> dict:
    kind = ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
            else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(error_body(str(err), err.code, err.status), status_code=err.status)


class Server:
    """The application and what its handlers share."""

    def __init__(self, engine, worker: Worker, model_name: str, defaults: Defaults, api_key: str | None = None,
                 max_body: int = MAX_BODY):
        self.engine, self.worker, self.model_name = engine, worker, model_name
        self.defaults, self.api_key, self.max_body = defaults, api_key, max_body
        self.created = int(time.time())
        routes = [
            Route(CHAT_URL, self.chat, methods=["POST"]),
            Route(TEXT_URL, self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                Exception: self._crash})

    # -- plumbing -------------------------------------------------------------------------

    def _count(self, endpoint: str, status: int) -> None:
        self.worker.metrics.requests.labels(endpoint, str(status)).inc()

    async def _http_error(self, request: HTTPRequest, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        msg = (f"no route {request.method} {request.url.path} (see GET /v1/models, POST {CHAT_URL}, POST {TEXT_URL})"
               if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(msg, code, exc.status_code), status_code=exc.status_code)

    async def _crash(self, request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", 500),
                            status_code=500)

    def _authorized(self, request: HTTPRequest) -> bool:
        if not self.api_key:
            return True
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _unauthorized(self, endpoint: str) -> JSONResponse:
        self._count(endpoint, 401)
        return _error(RequestError("missing or wrong API key: send the header Authorization: Bearer KEY",
                                   "invalid_api_key", 401))

    async def _json(self, request: HTTPRequest):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise RequestError(f"the body is {declared} bytes; at most {self.max_body} are accepted",
                               "body_too_large", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise RequestError(f"the body is over {self.max_body} bytes", "body_too_large", 413)
            chunks.append(chunk)
        data = b"".join(chunks)
        if not data.strip():
            raise RequestError("the body is empty: send a JSON object", "invalid_json")
        try:
            return json.loads(data)
        except UnicodeDecodeError:
            raise RequestError("the body is not UTF-8 text", "invalid_json") from None
        except json.JSONDecodeError as e:
            raise RequestError(f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                               "invalid_json") from None

    # -- routes ---------------------------------------------------------------------------

    async def health(self, request: HTTPRequest) -> Response:
        if self.worker.error:
            return JSONResponse({"status": "error", "error": self.worker.error}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name, "active": self.worker.totals.active,
                             "queued": self.worker.queue_length()})

    async def metrics(self, request: HTTPRequest) -> Response:
        if not self._authorized(request):
            return self._unauthorized("/metrics")
        return Response(self.worker.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: HTTPRequest) -> Response:
        if not self._authorized(request):
            return self._unauthorized("/v1/models")
        self._count("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "edgespec",
             "speculative": {"method": self.worker.method, "parallel": self.worker.n_parallel,
                             "context_per_sequence": self.engine.n_ctx_seq}}]})

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, CHAT_URL)

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, TEXT_URL)

    async def _generate(self, request: HTTPRequest, url: str) -> Response:
        if not self._authorized(request):
            return self._unauthorized(url)
        from ..batch.requests import fill_from_body

        req = Request(0, uuid.uuid4().hex[:24], max_tokens=self.defaults.max_tokens, sampling=self.defaults.sampling)
        try:
            body = await self._json(request)
            fill_from_body(req, url, body, self.defaults, allow_stream=True)
            req.tokens = self._tokens(req)
            req.sink = Sink(asyncio.get_running_loop())
            self.worker.submit(req)
        except RequestError as e:
            self._count(url, e.status)
            return _error(e)
        if req.stream:
            self._count(url, 200)
            return StreamingResponse(self._events(req, url), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        rec = await self._result(request, req)
        if rec is None:  # the client went away: nobody to answer
            return Response(status_code=499)
        status = rec["response"]["status_code"]
        self._count(url, status)
        return JSONResponse(rec["response"]["body"], status_code=status)

    def _tokens(self, req: Request) -> list[int]:
        eng = self.engine
        try:
            toks = (eng.prompt_tokens(messages=req.messages) if req.url == CHAT_URL
                    else eng.prompt_tokens(req.prompt, raw=True))
        except UnicodeEncodeError:
            raise RequestError("the prompt is not valid Unicode text (a lone surrogate such as \\ud800)") from None
        except Exception as e:  # a chat template that fails on these messages
            raise RequestError(f"cannot build the prompt: {e}") from None
        if len(toks) >= eng.n_ctx_seq:
            raise RequestError(f"the prompt is {len(toks)} tokens; a sequence's context holds {eng.n_ctx_seq} "
                               "(the server's -c)", "context_length_exceeded")
        check_grammar(eng, req.sampling.grammar)
        return toks

    async def _result(self, request: HTTPRequest, req: Request) -> dict | None:
        """The request's record, or None if the client disconnected first (its sequence is
        cancelled and its slot freed)."""

        async def done() -> dict:
            while True:
                kind, x = await req.sink.queue.get()
                if kind == "done":
                    return x

        async def gone() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        t_done, t_gone = asyncio.create_task(done()), asyncio.create_task(gone())
        try:
            await asyncio.wait({t_done, t_gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not t_done.done():
                req.cancelled = True
                t_done.cancel()
            t_gone.cancel()
        return t_done.result() if not t_done.cancelled() else None

    async def _events(self, req: Request, url: str):
        """Server-sent events: chunks as the text becomes final (stop strings cut), then one with
        finish_reason and the `speculative` object, the usage chunk if asked, and [DONE]."""
        chat = url == CHAT_URL
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.custom_id}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        logprobs = None  # of the next text chunk

        def chunk(piece: str | None, finish: str | None = None, first: bool = False, **extra) -> str:
            nonlocal logprobs
            lp, logprobs = logprobs, None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": lp, "finish_reason": finish}
            d = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice], **extra}
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, first=True)
            while True:
                kind, x = await req.sink.queue.get()
                if kind == "logprobs":
                    logprobs = x
                    continue
                if kind == "text":
                    yield chunk(x)
                    continue
                finished = True
                if x["error"] is not None:
                    yield f"data: {json.dumps(x['response']['body'], ensure_ascii=False)}\n\n"
                else:
                    body = x["response"]["body"]
                    yield chunk(None, body["choices"][0]["finish_reason"], speculative=body["speculative"])
                    if req.include_usage:
                        d = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                             "usage": body["usage"], "speculative": body["speculative"]}
                        yield f"data: {json.dumps(d)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away (or the server is going down): free the slot
                req.cancelled = True
