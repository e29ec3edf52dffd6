"""OpenAI-compatible HTTP API over an Engine, on FastAPI (served by uvicorn).

    POST /v1/completions         prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions    messages, through the model's chat template
    GET  /v1/models, /health, /metrics (Prometheus text)

Per request: max_tokens, temperature (0: greedy), top_p, top_k, stop, seed; response_format
(json_object, json_schema: serving/structured.py) and, on chat, tools and tool_choice
(serving/tool_calls.py). Errors come in
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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from serving import structured, tool_calls
from serving.engine import Engine, EngineStopped, Sampling
from serving.stop_strings import cut_at_stop

# How often a handler waiting for text checks that its client is still there and the engine
# still runs: well under a decode step, so a request whose client left ends within a step.
POLL_S = 0.02


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
    seed: int | None = None
    response_format: dict | None = None               # structured output (serving/structured.py)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None
    # Tool calling (serving/tool_calls.py): an assistant's calls, a tool's answer to one.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @property
    def calls_tools(self) -> bool:
        """Tools are offered: rendered by the chat template, calls read from the answer."""
        return bool(self.tools) and self.tool_choice != "none"


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
        try:
            messages = tool_calls.template_messages([m.model_dump(exclude_none=True) for m in body.messages])
            tools = {"tools": body.tools} if body.calls_tools else {}
            if tools:
                tool_calls.check(body.tools, body.tool_choice)
                tool_calls.call_format(tokenizer.chat_template)
        except tool_calls.ToolError as error:
            raise ApiError(400, str(error), error.param) from None
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **tools)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def constraint(body: _Common) -> tuple[Any, str | None]:
        """(the request's Constraint or None, its tool-call format or None): from
        response_format, or from tool_choice "required" or a named function."""
        calls = isinstance(body, ChatRequest) and body.calls_tools
        fmt = tool_calls.call_format(engine.tokenizer.chat_template) if calls else None
        try:
            grammar = structured.response_format_grammar(body.response_format)
        except ValueError as error:
            raise ApiError(400, str(error), "response_format") from None
        forced = calls and body.tool_choice not in (None, "auto")
        if forced and grammar is not None:
            raise ApiError(400, "response_format and a tool_choice that forces a call both shape the answer: "
                                "send one of them", "response_format")
        if forced:
            grammar = tool_calls.grammar(body.tools, tool_calls.check(body.tools, body.tool_choice), fmt,
                                         engine.grammars)
        if grammar is None:
            return None, fmt
        try:
            return engine.grammars.constraint(grammar), fmt
        except ValueError as error:
            raise ApiError(400, f"the grammar of this request cannot be used: {error}",
                           "tools" if forced else "response_format") from None

    async def run(http: Request, body: _Common, prompt: list[int], chat: bool):
        check_model(body.model)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        settings = sampling(body, len(prompt))
        # Compiling a grammar takes milliseconds (the first one, llguidance's tokenizer: seconds).
        settings.constraint, tool_format = await asyncio.to_thread(constraint, body)
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
            return StreamingResponse(_stream(http, request, pieces, ident, created, chat, stops, tool_format),
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
            raise ApiError(500, request.error or "the request failed")
        reason = "stop" if stopped else _reason(request.finish_reason)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(request.tokens),
                 "total_tokens": len(prompt) + len(request.tokens),
                 "prompt_tokens_details": {"cached_tokens": request.reused}}
        if chat:
            message = {"role": "assistant", "content": text}
            if tool_format is not None:
                content, calls = tool_calls.parse(text, tool_format)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
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
                      stops: list[str], tool_format: str | None = None):
        kind = "chat.completion.chunk" if chat else "text_completion"
        # Text that may be a tool call is held back until the end, then sent as tool_calls deltas.
        splitter = tool_calls.StreamSplitter(tool_format) if tool_format is not None else None

        def event(text: str | None, reason: str | None, first: bool = False,
                  delta: dict | None = None) -> str:
            if chat and delta is not None:
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            elif chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            chunk = {"id": ident, "object": kind, "created": created, "model": engine.name,
                     "choices": [choice]}
            return f"data: {json.dumps(chunk)}\n\n"

        sent, stopped = "", False
        try:
            if chat:
                yield event(None, None, first=True)
            try:
                async for piece in _pieces(None, request, pieces):
                    text, stopped = _cut_at_stop(sent + piece, stops)
                    if len(text) > len(sent):
                        new = text[len(sent):] if splitter is None else splitter.feed(text[len(sent):])
                        if new:
                            yield event(new, None)
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
            reason = "stop" if stopped else _reason(request.finish_reason)
            if splitter is not None:
                rest, calls = splitter.finish()
                if rest:
                    yield event(rest, None)
                for index, call in enumerate(calls):
                    function = call["function"]
                    yield event(None, None, delta={"tool_calls": [
                        {"index": index, "id": call["id"], "type": "function",
                         "function": {"name": function["name"], "arguments": ""}}]})
                    yield event(None, None, delta={"tool_calls": [
                        {"index": index, "function": {"arguments": function["arguments"]}}]})
                reason = "tool_calls" if calls and reason == "stop" else reason
            yield event(None, reason)
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


def _reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason for the batcher's."""
    return {"stop": "stop", "length": "length"}.get(finish_reason or "", "stop")
