"""OpenAI-compatible HTTP API over an Engine, on FastAPI (served by uvicorn).

    POST /v1/completions         prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions    messages, through the model's chat template
    GET  /v1/models, /health, /metrics (Prometheus text)

Per request: max_tokens, temperature (0: greedy), top_p, top_k, stop, seed. Errors come in
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status: a prompt
over the context length, malformed JSON, a wrong field, an unknown model. A request that
fails while it runs is a 500 in that shape (an error event, then the end, in a stream), never
a finish_reason; its neighbours go on. A stopped engine is a 503, and /health says so. A
client that goes away, streaming or not, has its request cancelled within a step, which frees
its batch line.

Guards before the app (create_app's settings): a body over max_request_bytes is a 413; with
an api_key, every route but /health and /metrics wants it as a Bearer token (401); a full waiting queue
is a 429 with Retry-After; /docs and /openapi.json are served only with docs=True. Prompts
are tokenized and chat templates rendered off the event loop, so streams go on meanwhile.
A stream never shows any part of a stop string: text that may begin one is held back until
the following text settles it.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from serving.auth import BearerAuth
from serving.engine import Engine, EngineStopped, QueueFull, Sampling
from serving.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from serving.stop_strings import cut_at_stop, held_back
from serving.text_checks import invalid_text

# How often a handler waiting for text checks that its client is still there and the engine
# still runs: well under a decode step, so a request whose client left ends within a step.
POLL_S = 0.02
# What a 429 (the waiting queue is full) tells a client to wait before it tries again.
RETRY_AFTER_S = 1


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")          # fields we do not use (user, logit_bias...) are ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Any finite temperature >= 0, as vLLM takes it (OpenAI's own API stops at 2).
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)     # a 64-bit seed, as vLLM takes


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _ClientLeft(Exception):
    """The client of a request closed its connection."""


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param, code), status_code=status)


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to the first stop string, and whether one was found."""
    cut = cut_at_stop(text, stops)
    return (text, False) if cut is None else (text[:cut], True)


def create_app(engine: Engine, *, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, docs: bool = False) -> FastAPI:
    """The API over a started engine. api_key: wanted as a Bearer token on every route but
    /health (None: open); max_request_bytes: larger bodies get a 413; docs: serve /docs and
    /openapi.json. The waiting queue's bound is the engine's (Engine(max_waiting=...))."""
    shown = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pyhlo", description="OpenAI-compatible completions over a pyhlo model", **shown)
    app.state.engine = engine
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)        # added last: runs first

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, error: QueueFull) -> JSONResponse:
        response = _error(429, str(error), code="queue_full")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return _error(400, f"{where}: {message}" if where else message, where or None)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return _error(error.status_code, str(error.detail))

    def check_model(name: str | None) -> None:
        if name not in (None, "", engine.name):
            raise ApiError(404, f"the model {name!r} does not exist; this server has {engine.name!r}",
                           "model", "model_not_found")

    def sampling(body: _Common, prompt_tokens: int) -> Sampling:
        room = engine.n_positions - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens; this model's context is "
                                f"{engine.n_positions} tokens, so at most {engine.n_positions - 1}",
                           "messages" if isinstance(body, ChatRequest) else "prompt",
                           "context_length_exceeded")
        wanted = body.max_completion_tokens or body.max_tokens
        if wanted is not None and wanted > room:
            raise ApiError(400, f"max_tokens {wanted} + the prompt's {prompt_tokens} tokens exceed the "
                                f"context of {engine.n_positions} tokens", "max_tokens",
                           "context_length_exceeded")
        default = 16 if isinstance(body, CompletionRequest) else room
        return Sampling(max_tokens=wanted or min(default, room), temperature=body.temperature,
                        top_p=body.top_p, top_k=body.top_k, seed=body.seed)

    def completion_prompt(body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (n=1 and a single prompt)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(engine.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def chat_prompt(body: ChatRequest) -> list[int]:
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           "messages")
        ids = tokenizer.apply_chat_template([m.model_dump() for m in body.messages],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def tokenized(make_prompt, body: _Common) -> list[int]:
        """make_prompt(body) in a worker thread (tokenizing a long prompt takes long), once every
        string of the body is known to be valid Unicode."""
        bad = invalid_text(body.model_dump())
        if bad is not None:
            raise ApiError(400, bad[1], bad[0] or None, "invalid_unicode")
        return await run_in_threadpool(make_prompt, body)

    def failure_status() -> int:
        """A request the engine ended with an error: 503 while the server shuts down (a client
        may try another replica), 500 otherwise."""
        return 503 if engine.refusal is not None else 500

    async def run(http: Request, body: _Common, prompt: list[int], chat: bool):
        check_model(body.model)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        settings = sampling(body, len(prompt))
        loop = asyncio.get_running_loop()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            request, pieces = engine.submit(prompt, settings, loop, label=ident)
        except ValueError as error:
            raise ApiError(400, str(error), "prompt") from None
        except EngineStopped as error:
            raise ApiError(503, str(error)) from None
        created = int(time.time())
        stops = _stops(body.stop)
        if body.stream:
            return StreamingResponse(_stream(http, request, pieces, ident, created, chat, stops),
                                     media_type="text/event-stream")
        text, stopped = "", False
        try:
            async for piece in _pieces(http, request, pieces):
                text, stopped = _cut_at_stop(text + piece, stops)
                if stopped:
                    engine.cancel(request, "stop")
                    break
        except (asyncio.CancelledError, _ClientLeft) as gone:
            engine.cancel(request)
            if isinstance(gone, _ClientLeft):
                return Response(status_code=499)              # nobody reads it
            raise
        except EngineStopped as error:
            raise ApiError(503, str(error)) from None
        if not stopped and request.finish_reason == "error":
            raise ApiError(failure_status(), request.error or "the request failed")
        reason = "stop" if stopped else _reason(request.finish_reason)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(request.tokens),
                 "total_tokens": len(prompt) + len(request.tokens),
                 "prompt_tokens_details": {"cached_tokens": request.reused}}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": None}
            return {"id": ident, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {"id": ident, "object": "text_completion", "created": created, "model": engine.name,
                "choices": [choice], "usage": usage}

    async def _pieces(http: Request | None, request, pieces: asyncio.Queue):
        """A request's text pieces as the engine sends them. While it waits, it checks every
        POLL_S that the engine runs (EngineStopped if not) and, given http, that the client is
        still there (_ClientLeft if not). Streams pass no http: their response listens for the
        disconnect itself, and two readers would take each other's messages."""
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(pieces.get())
                done, _ = await asyncio.wait({getter}, timeout=POLL_S)
                if done:
                    piece, getter = getter.result(), None
                    if piece is None:
                        return
                    yield piece
                elif not engine.alive:
                    raise EngineStopped(engine.failure or "the engine is not running")
                elif http is not None and await http.is_disconnected():
                    raise _ClientLeft()
        finally:
            if getter is not None:
                getter.cancel()

    async def _stream(http: Request, request, pieces: asyncio.Queue, ident: str, created: int, chat: bool,
                      stops: list[str]):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            chunk = {"id": ident, "object": kind, "created": created, "model": engine.name,
                     "choices": [choice]}
            return f"data: {json.dumps(chunk)}\n\n"

        # text: everything received, up to a stop string once one is found; sent: what the
        # client has. The end of text that may begin a stop string waits for what follows.
        text, sent, stopped = "", 0, False
        try:
            if chat:
                yield event(None, None, first=True)
            try:
                async for piece in _pieces(None, request, pieces):
                    text, stopped = _cut_at_stop(text + piece, stops)
                    ready = len(text) if stopped else len(text) - held_back(text, stops)
                    if ready > sent:
                        yield event(text[sent:ready], None)
                        sent = ready
                    if stopped:
                        engine.cancel(request, "stop")
                        break
            except EngineStopped as error:
                failed = _error_body(503, str(error))
            else:
                failed = None if stopped or request.finish_reason != "error" else \
                    _error_body(failure_status(), request.error or "the request failed")
            if failed is not None:
                # An error event (OpenAI's clients raise it), then the end, as vLLM ends a stream.
                yield f"data: {json.dumps(failed)}\n\n"
                yield "data: [DONE]\n\n"
                return
            if len(text) > sent:              # held back, and no stop string came: it is text
                yield event(text[sent:], None)
            yield event(None, "stop" if stopped else _reason(request.finish_reason))
            yield "data: [DONE]\n\n"
        finally:
            # The client went away (the generator is closed) or the answer is done: either way
            # the request holds no batch line once this returns.
            engine.cancel(request)

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        return await run(http, body, await tokenized(completion_prompt, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatRequest):
        return await run(http, body, await tokenized(chat_prompt, body), chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "pyhlo", "max_model_len": engine.n_positions}]}

    @app.get("/health")
    async def health():
        if not engine.alive or engine.refusal is not None:
            return _error(503, engine.failure or engine.refusal or "the engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason for the batcher's."""
    return {"stop": "stop", "length": "length"}.get(finish_reason or "", "stop")
