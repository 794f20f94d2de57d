"""The HTTP side of `edgespec serve` (Starlette): OpenAI's routes, the key check, the body limit,
server-sent events. Every request body is validated by the schema `edgespec batch` uses
(`edgespec.serving.schema`); every answer carries batch's `speculative` object. Nothing here touches
llama.cpp's contexts: requests go to the engine's thread (`worker`) and come back through a
`Sink`. A bad request gets a 4xx in OpenAI's error shape; no request ends the server.

The event loop only moves bytes: parsing, templating and tokenizing run in one thread of their
own (`_prepare`), after a body far longer than the context is refused, so `/health` and the
streams of other requests answer while a huge body is read. Only `application/json` bodies are
read (a web page cannot send one to another origin without CORS's consent, `--cors`); on a
loopback address the Host header must name a loopback host (DNS rebinding)."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...serving.requests import Defaults, Request, prompt_of
from ...serving.schema import CHAT_URL, TEXT_URL, RequestError
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
READ_TIMEOUT = 30.0  # seconds a request's body may take to arrive


class _Gone(Exception):
    """The client went away before its request was read."""


def error_body(message: str, code: str, status: int) -> dict:
    kind = ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
            else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(error_body(str(err), err.code, err.status), status_code=err.status)


def is_local_host(header: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.x.y.z or [::1], with
    or without a port."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1:h.find("]")] if "]" in h else ""
    elif h.count(":") == 1:
        h = h.split(":")[0]
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class _LoopbackHostOnly:
    """ASGI middleware: a request whose Host header is not a loopback name is refused (421), so a
    web page whose name was rebound to 127.0.0.1 cannot read a loopback server's answers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and not is_local_host(host):
                msg = (f"Host {host[:80]!r} is not this machine's loopback name: a server on a loopback address "
                       "answers only requests for localhost, 127.0.0.1 or [::1] (bind --host to serve others)")
                await JSONResponse(error_body(msg, "invalid_host", 421), status_code=421)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    """The application and what its handlers share. `local_only`: check the Host header (a
    loopback bind); `cors`: browser origins allowed to call the API (CORS), none by default."""

    def __init__(self, engine, worker: Worker, model_name: str, defaults: Defaults, api_key: str | None = None,
                 max_body: int = MAX_BODY, local_only: bool = True, cors: list[str] | tuple[str, ...] = (),
                 read_timeout: float = READ_TIMEOUT):
        self.engine, self.worker, self.model_name = engine, worker, model_name
        self.defaults, self.api_key, self.max_body = defaults, api_key, max_body
        self.read_timeout = read_timeout
        # requests sharing drafting state (the lookahead trie) share its keys: with a key, the
        # key's holders; without one, nobody (see serving.loop's `share`)
        self.share = "" if api_key else None
        self.created = int(time.time())
        target = engine.target
        target.control_tokens  # noqa: B018 - found now, not by two threads at once
        # a text of B bytes is at least B / longest tokens long: longer than the context is refused unread
        self.max_prompt_bytes = engine.n_ctx_seq * target.longest_piece
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="edgespec-prepare")
        routes = [
            Route(CHAT_URL, self.chat, methods=["POST"]),
            Route(TEXT_URL, self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        middleware = [Middleware(_LoopbackHostOnly)] if local_only else []
        if cors:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                                         allow_headers=["Authorization", "Content-Type"], max_age=600))
        self.app = Starlette(routes=routes, middleware=middleware,
                             exception_handlers={HTTPException: self._http_error, Exception: self._crash})

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    # -- plumbing -------------------------------------------------------------------------

    def _count(self, endpoint: str, status: int) -> None:
        self.worker.metrics.requests.labels(endpoint, str(status)).inc()

    async def _http_error(self, request: HTTPRequest, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        msg = (f"no route {request.method} {request.url.path} (see GET /v1/models, POST {CHAT_URL}, POST {TEXT_URL})"
               if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(msg, code, exc.status_code), status_code=exc.status_code,
                            headers=exc.headers)  # a 405's Allow

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

    async def _body(self, request: HTTPRequest) -> bytes:
        """The body's bytes: JSON only (415), at most `max_body` (413), within `read_timeout`
        (408); `_Gone` if the client leaves while sending it."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise RequestError(f"the body must be sent as Content-Type: application/json (got {ctype[:60] or 'none'!r})",
                               "unsupported_media_type", 415)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise RequestError(f"the body is {declared} bytes; at most {self.max_body} are accepted",
                               "body_too_large", 413)

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise RequestError(f"the body is over {self.max_body} bytes", "body_too_large", 413)
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the body did not arrive within {self.read_timeout:g} s", "request_timeout",
                               408) from None
        except ClientDisconnect:
            raise _Gone from None

    def _prepare(self, url: str, data: bytes) -> Request:
        """In the preparing thread: the body parsed, checked, bounded and tokenized."""
        from ...serving.requests import fill_from_body

        if not data.strip():
            raise RequestError("the body is empty: send a JSON object", "invalid_json")
        try:
            body = json.loads(data)
        except UnicodeDecodeError:
            raise RequestError("the body is not UTF-8 text", "invalid_json") from None
        except json.JSONDecodeError as e:
            raise RequestError(f"the body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                               "invalid_json") from None
        except RecursionError:
            raise RequestError("the body is not valid JSON: it nests too deeply", "invalid_json") from None
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise RequestError(f"the body is not valid JSON: {e}", "invalid_json") from None
        req = Request(0, uuid.uuid4().hex[:24], max_tokens=self.defaults.max_tokens, sampling=self.defaults.sampling,
                      share=self.share)
        fill_from_body(req, url, body, self.defaults, allow_stream=True)
        self._bound(req)
        req.tokens = self._tokens(req)
        return req

    def _bound(self, req: Request) -> None:
        """Refuse a prompt that cannot fit in the context before it is templated or tokenized."""
        n_ctx = self.engine.n_ctx_seq
        texts = ([req.prompt or "", req.suffix or ""] if req.messages is None
                 else [m["content"] or "" for m in req.messages])
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if req.messages is not None:  # the tools and the calls in the history are prompt text too
            size += sum(len(c["function"]["arguments"].encode("utf-8", "surrogatepass")) + len(c["function"]["name"])
                        for m in req.messages for c in m.get("tool_calls") or ())
            size += len(json.dumps(req.tools or []))
        if size > self.max_prompt_bytes or (req.messages is not None and len(req.messages) >= n_ctx):
            what = f"{len(req.messages)} messages, " if req.messages is not None else ""
            raise RequestError(f"the prompt ({what}{size} bytes of text) cannot fit in a sequence's context of "
                               f"{n_ctx} tokens (the server's -c)", "context_length_exceeded")

    # -- routes ---------------------------------------------------------------------------

    async def health(self, request: HTTPRequest) -> Response:
        if self.worker.error:
            return JSONResponse({"status": "error", "error": self.worker.error}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name, "active": self.worker.totals.active,
                             "queued": self.worker.queue_length(), "inflight": self.worker.inflight()})

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
        try:
            data = await self._body(request)
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(self._prep, self._prepare, url, data)
            req.sink = Sink(loop)
            self.worker.submit(req)
        except RequestError as e:
            self._count(url, e.status)
            resp = _error(e)
            if e.status == 408:  # the rest of the body is not waited for
                resp.headers["Connection"] = "close"
            return resp
        except _Gone:
            log.info("a client left while sending its request to %s", url)
            self._count(url, 499)
            return Response(status_code=499)
        if req.stream:
            self._count(url, 200)
            return StreamingResponse(self._events(req, url), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        rec = await self._result(request, req)
        if rec is None:  # the client went away: nobody to answer
            self._count(url, 499)
            return Response(status_code=499)
        status = rec["response"]["status_code"]
        self._count(url, status)
        return JSONResponse(rec["response"]["body"], status_code=status)

    def _tokens(self, req: Request) -> list[int]:
        eng = self.engine
        try:
            toks = prompt_of(eng, req)
        except RequestError:
            raise
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
            answered = t_done.done() and not t_done.cancelled()
            if not answered:
                self.worker.cancel(req)
                t_done.cancel()
            t_gone.cancel()
        return t_done.result() if answered else None

    @staticmethod
    def _held(hold, message: dict) -> list[dict]:
        """The deltas of what a tools stream held back: the rest of the content, then each call."""
        out = []
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        rest = content[len(hold.sent.lstrip()):] if calls else content[len(hold.sent):]
        if rest:
            out.append({"content": rest})
        for i, c in enumerate(calls):
            out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        return out

    async def _events(self, req: Request, url: str):
        """Server-sent events: chunks as the text becomes final (stop strings cut), then one with
        finish_reason and the `speculative` object, the usage chunk if asked, and [DONE]. With
        n > 1 the choices' chunks interleave, each with its `index`, and each choice gets its own
        finish chunk (the last one carries `speculative`, summed over the choices). Completions
        with `echo` send the prompt as the first chunk.

        With tools offered, text from the first `<tool_call>` on is held; when the answer is
        complete its calls go out as OpenAI streams them (per call: a delta with index, id,
        type and function.name, then one with function.arguments), and held text that was no
        call as content."""
        from ...tools import CallHold

        chat = url == CHAT_URL
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.custom_id}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        logprobs: dict[int, dict] = {}  # by choice: of its next text chunk

        def chunk(piece: str | None, finish: str | None = None, first: bool = False, delta: dict | None = None,
                  index: int = 0, **extra) -> str:
            lp = logprobs.pop(index, None)
            if chat:
                if delta is None:
                    delta = ({"role": "assistant", "content": ""} if first else {} if piece is None
                             else {"content": piece})
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": piece or "", "logprobs": lp, "finish_reason": finish}
            d = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice], **extra}
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        holds = {i: CallHold(req.tool_names) for i in range(req.n)} if chat and req.tool_names else None
        finished = False
        try:
            for i in range(req.n):
                if chat:
                    yield chunk(None, first=True, index=i)
                elif req.echo:
                    yield chunk(req.prompt, index=i)
            while True:
                kind, x = await req.sink.queue.get()
                index = 0
                if kind in ("text", "logprobs") and isinstance(x, tuple):  # a choice of n > 1
                    index, x = x
                if kind == "logprobs":
                    held = logprobs.get(index)
                    if held is not None and chat:  # held text's: they go with the next chunk
                        logprobs[index] = {**held, "content": held["content"] + x["content"]}
                    else:
                        logprobs[index] = x
                    continue
                if kind == "text":
                    if holds is not None:
                        x = holds[index].feed(x)
                        if not x:
                            continue
                    yield chunk(x, index=index)
                    continue
                finished = True
                if x["error"] is not None:
                    yield f"data: {json.dumps(x['response']['body'], ensure_ascii=False)}\n\n"
                else:
                    body = x["response"]["body"]
                    choices = body["choices"]
                    for ch in choices:
                        i = ch["index"]
                        if holds is not None:
                            for c in self._held(holds[i], ch["message"]):
                                yield chunk(None, delta=c, index=i)
                        extra = {"speculative": body["speculative"]} if i == len(choices) - 1 else {}
                        yield chunk(None, ch["finish_reason"], index=i, **extra)
                    if req.include_usage:
                        d = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                             "usage": body["usage"], "speculative": body["speculative"]}
                        yield f"data: {json.dumps(d)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away (or the server is going down): free the slot
                self.worker.cancel(req)
