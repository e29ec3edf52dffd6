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
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from serving.engine import Engine, EngineStopped, Sampling
from serving.logprobs import ChoiceLogprobs, Offsets, completion_logprobs, joined
from serving.request_fields import BODIES, ChatRequest, Common, CompletionRequest, describe
from serving.stop_strings import cut_at_stop
from serving.tokenizer_routes import tokenizer_routes

# How often a handler waiting for text checks that its client is still there and the engine
# still runs: well under a decode step, so a request whose client left ends within a step.
POLL_S = 0.02


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


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="pyhlo", description="OpenAI-compatible completions over a pyhlo model")
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(http: Request, error: RequestValidationError) -> JSONResponse:
        body = BODIES.get(http.url.path, CompletionRequest)
        return _error(400, *describe(list(error.errors()), set(body.model_fields)))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return _error(error.status_code, str(error.detail))

    def check_model(name: str | None) -> None:
        if name not in (None, "", engine.name):
            raise ApiError(404, f"the model {name!r} does not exist; this server has {engine.name!r}",
                           "model", "model_not_found")

    def sampling(body: Common, prompt_tokens: int) -> Sampling:
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
        vocab = engine.model.decoder.head.vocab_size
        if any(not 0 <= token < vocab for token in body.logit_bias or {}):
            raise ApiError(400, f"logit_bias: token ids must lie in 0..{vocab - 1}", "logit_bias")
        if body.n != 1:
            raise ApiError(400, "n: pyhlo gives one choice per request (n: 1)", "n")
        default = 16 if isinstance(body, CompletionRequest) else room
        return Sampling(max_tokens=wanted or min(default, room),
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=body.top_p or 1.0, top_k=max(body.top_k or 0, 0), seed=body.seed,
                        repetition_penalty=body.repetition_penalty or 1.0,
                        presence_penalty=body.presence_penalty or 0.0,
                        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=body.logit_bias,
                        logprobs=body.top_logprobs_wanted,
                        prompt_logprobs=getattr(body, "prompt_logprobs_wanted", None))

    def completion_prompt(body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
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
        ids = tokenizer.apply_chat_template([m.for_template() for m in body.messages],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def run(http: Request, body: Common, prompt: list[int], chat: bool):
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
        echoed = _echo(body, prompt) if not chat and body.echo else ""
        reported = None if settings.logprobs is None else \
            ChoiceLogprobs(engine.tokenizer, request, chat, text_start=len(echoed))
        if body.stream:
            usage = (lambda: _usage(prompt, request)) if body.include_usage else None
            echo = (lambda: (echoed, prompt_logprobs(request, prompt, reported))) if echoed else None
            events = _stream(http, request, pieces, ident, created, chat, stops, reported, usage, echo)
            return StreamingResponse(events, media_type="text/event-stream")
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
            raise ApiError(500, request.error or "the request failed")
        reason = "stop" if stopped else _reason(request.finish_reason)
        usage = _usage(prompt, request)
        logprobs = reported.upto(len(text)) if reported else None
        if echoed:
            text = echoed + text
            if logprobs is not None:
                logprobs = joined(prompt_logprobs(request, prompt, reported), logprobs)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": logprobs}
            return {"id": ident, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
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
                      stops: list[str], reported: ChoiceLogprobs | None = None, usage=None, echo=None):
        """usage: a function giving the usage, for a last chunk with it (stream_options.include_usage);
        echo: one giving the echoed prompt and its logprobs, for a first chunk with them."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        echoing = [echo] if echo is not None else []

        def event(text: str | None, reason: str | None, first: bool = False, sent: str = "",
                  logprobs: dict | None = None) -> str:
            if echoing:
                # The echoed prompt first, once its logprobs are there: with the first token.
                echoed, of_prompt = echoing.pop()()
                return event(echoed, None, logprobs=of_prompt) + event(text, reason, first, sent)
            if logprobs is None and reported and not first:
                logprobs = reported.upto(len(sent))
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
            chunk = {"id": ident, "object": kind, "created": created, "model": engine.name,
                     "choices": [choice], **({"usage": None} if usage else {})}
            return f"data: {json.dumps(chunk)}\n\n"

        sent, stopped = "", False
        try:
            if chat:
                yield event(None, None, first=True)
            try:
                async for piece in _pieces(None, request, pieces):
                    text, stopped = _cut_at_stop(sent + piece, stops)
                    if len(text) > len(sent):
                        yield event(text[len(sent):], None, sent=text)
                        sent = text
                    if stopped:
                        engine.cancel(request, "stop")
                        break
            except EngineStopped as error:
                failed = _error_body(503, str(error))
            else:
                failed = None if stopped or request.finish_reason != "error" else \
                    _error_body(500, request.error or "the request failed")
            if failed is not None:           # an error event (as OpenAI's clients read it), then the end
                yield f"data: {json.dumps(failed)}\n\n"
                return
            yield event(None, "stop" if stopped else _reason(request.finish_reason), sent=sent)
            if usage is not None:               # OpenAI's last chunk: no choices, the usage
                chunk = {"id": ident, "object": kind, "created": created, "model": engine.name, "choices": [],
                         "usage": usage()}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # The client went away (the generator is closed) or the answer is done: either way
            # the request holds no batch line once this returns.
            engine.cancel(request)

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        return await run(http, body, completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatRequest):
        return await run(http, body, chat_prompt(body), chat=True)

    app.include_router(tokenizer_routes(engine, check_model, ApiError))

    def _echo(body: CompletionRequest, prompt: list[int]) -> str:
        """The prompt as echoed: its text as sent, else its tokens decoded."""
        sent = body.prompt[0] if isinstance(body.prompt, list) and body.prompt else body.prompt
        return sent if isinstance(sent, str) else engine.tokenizer.decode(prompt, skip_special_tokens=True)

    def prompt_logprobs(request, prompt: list[int], reported: ChoiceLogprobs | None) -> dict | None:
        """The echoed prompt's logprobs (the answer's first token is there by now: so is the
        whole prompt's)."""
        if reported is None:
            return None
        entries = request.prompt_token_logprobs or [None]
        offsets = Offsets(engine.tokenizer, prompt)
        starts = [offsets.start(i) for i in range(len(prompt))]
        return completion_logprobs(engine.tokenizer, entries, prompt, starts)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "pyhlo", "max_model_len": engine.n_positions}]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error(503, engine.failure or "the engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _usage(prompt: list[int], request) -> dict[str, Any]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(request.tokens),
            "total_tokens": len(prompt) + len(request.tokens),
            "prompt_tokens_details": {"cached_tokens": request.reused}}


def _reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason for the batcher's."""
    return {"stop": "stop", "length": "length"}.get(finish_reason or "", "stop")
