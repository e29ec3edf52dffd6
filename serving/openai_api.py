"""OpenAI-compatible HTTP API over an Engine, on FastAPI (served by uvicorn).

    POST /v1/completions         prompt(s) (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions    messages, through the model's chat template
    POST /tokenize, /detokenize, GET /tokenizer_info (tokenizer_routes.py, as vLLM serves them)
    GET  /v1/models, /health, /metrics (Prometheus text)

The fields each body takes, and the 400 naming any other, are in request_fields.py; the
logprobs' shapes in logprobs.py; response_format (json_object, json_schema) in structured.py;
tools and tool_choice (chat) in tool_calls.py. n choices per prompt share its computed prefix. Errors come in
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status: a prompt
over the context length, malformed JSON, a wrong field, an unknown model. A request that
fails while it runs is a 500 in that shape (an error event, then the end, in a stream), never
a finish_reason; its neighbours go on. A stopped engine is a 503, and /health says so. A
client that goes away, streaming or not, has its request cancelled within a step, which frees
its batch line.

Guards before the app (create_app's settings): a body over max_request_bytes is a 413; with
an api_key, every route but /health and /metrics wants it as a Bearer token (401); a full
waiting queue is a 429 with Retry-After; /docs and /openapi.json are served only with
docs=True. Prompts are tokenized and chat templates rendered off the event loop, so streams go
on meanwhile. A stream never shows any part of a stop string: text that may begin one is held
back until the following text settles it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from serving import structured, tool_calls
from serving.auth import BearerAuth
from serving.engine import Engine, EngineStopped, QueueFull, Sampling
from serving.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from serving.logprobs import ChoiceLogprobs, Offsets, completion_logprobs, joined
from serving.request_fields import BODIES, ChatRequest, Common, CompletionRequest, describe
from serving.stop_strings import cut_at_stop, held_back
from serving.text_checks import invalid_text
from serving.tokenizer_routes import tokenizer_routes

# How often a handler waiting for text checks that its client is still there and the engine
# still runs: well under a decode step, so a request whose client left ends within a step.
POLL_S = 0.02
# Choices in one request (prompts x n): each takes a batch line or waits for one.
MAX_CHOICES = 128
# What a 429 (the waiting queue is full) tells a client to wait before it tries again.
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _ClientLeft(Exception):
    """The client of a request closed its connection."""


class _ChoiceFailed(Exception):
    """A choice's request failed while it streamed: body is the error event to send."""

    def __init__(self, body: dict[str, Any]):
        super().__init__(body["error"]["message"])
        self.body = body


@dataclasses.dataclass
class _Choice:
    """One choice of a response: its request in the engine and what its answer needs."""

    index: int
    prompt: list[int]
    request: Any
    pieces: asyncio.Queue
    reported: ChoiceLogprobs | None        # its logprobs, where asked for
    echoed: str = ""                       # the prompt's text before its answer (completions' echo)
    tool_format: str | None = None         # how its answer writes tool calls, where tools are offered


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
    /health and /metrics (None: open); max_request_bytes: larger bodies get a 413; docs: serve
    /docs and /openapi.json. The waiting queue's bound is the engine's (Engine(max_waiting=...))."""
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
        default = 16 if isinstance(body, CompletionRequest) else room
        return Sampling(max_tokens=wanted or min(default, room),
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=body.top_p or 1.0, top_k=max(body.top_k or 0, 0), seed=body.seed,
                        repetition_penalty=body.repetition_penalty or 1.0,
                        presence_penalty=body.presence_penalty or 0.0,
                        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=body.logit_bias,
                        logprobs=body.top_logprobs_wanted,
                        prompt_logprobs=getattr(body, "prompt_logprobs_wanted", None))

    def completion_prompts(body: CompletionRequest) -> list[list[int]]:
        """The prompts of a completions request: one text or token list, or a list of them."""
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and \
            isinstance(body.prompt[0], (str, list)) else [body.prompt]
        return [list(engine.tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts]

    def chat_prompt(body: ChatRequest) -> list[int]:
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           "messages")
        try:
            messages = tool_calls.template_messages([m.for_template() for m in body.messages])
            tools = {"tools": body.tools} if body.calls_tools else {}
            if tools:
                tool_calls.check(body.tools, body.tool_choice)
                tool_calls.call_format(tokenizer.chat_template)
        except tool_calls.ToolError as error:
            raise ApiError(400, str(error), error.param) from None
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **tools)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def constraints(body: Common) -> tuple[Any, str | None]:
        """(a function giving each choice its own Constraint, or None; the answer's tool-call
        format, or None): from response_format, or from a tool_choice of "required" or a named
        function. Compiling a grammar takes milliseconds (the first, llguidance's tokenizer:
        seconds), so this runs in a worker thread."""
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
            made = [engine.grammars.constraint(grammar)]
        except ValueError as error:
            raise ApiError(400, f"the grammar of this request cannot be used: {error}",
                           "tools" if forced else "response_format") from None
        return (lambda: made.pop() if made else engine.grammars.constraint(grammar)), fmt

    async def tokenized(make_prompts, body: Common) -> list[list[int]]:
        """make_prompts(body) in a worker thread (tokenizing a long prompt takes long), once every
        string of the body is known to be valid Unicode."""
        bad = invalid_text(body.model_dump())
        if bad is not None:
            raise ApiError(400, bad[1], bad[0] or None, "invalid_unicode")
        return await run_in_threadpool(make_prompts, body)

    def failure_status() -> int:
        """A request the engine ended with an error: 503 while the server shuts down (a client
        may try another replica), 500 otherwise."""
        return 503 if engine.refusal is not None else 500

    def submit(body: Common, prompts: list[list[int]], chat: bool, ident: str, constraint=None,
               tool_format: str | None = None) -> list[_Choice]:
        """Every choice of a request queued: n for each prompt (index prompt * n + k), choice
        k sampling with seed + k, so each is reproducible; none is queued if one is refused.
        constraint: gives each choice its own grammar state (structured output, forced calls)."""
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n {body.n} choices: at most {MAX_CHOICES} per "
                                "request", "n")
        planned = []
        for p, prompt in enumerate(prompts):
            if not prompt:
                raise ApiError(400, "the prompt is empty", "prompt")
            settings = sampling(body, len(prompt))
            echoed = _echo(body, p, prompt) if not chat and body.echo else ""
            for k in range(body.n):
                seed = settings.seed if k == 0 or settings.seed is None else (settings.seed + k) % 2**63
                own = constraint() if constraint is not None else None
                settings_k = dataclasses.replace(settings, seed=seed, constraint=own)
                planned.append((p * body.n + k, prompt, settings_k, echoed))
        loop = asyncio.get_running_loop()
        choices: list[_Choice] = []
        try:
            for index, prompt, settings, echoed in planned:
                label = ident if len(planned) == 1 else f"{ident}-{index}"
                # A prompt's first choice computes it; its other choices start from a copy.
                leader = choices[-(index % body.n)].request if index % body.n else None
                request, pieces = engine.submit(prompt, settings, loop, label=label, shares_prompt_of=leader)
                reported = None if settings.logprobs is None else \
                    ChoiceLogprobs(engine.tokenizer, request, chat, text_start=len(echoed))
                choices.append(_Choice(index, prompt, request, pieces, reported, echoed, tool_format))
        except (ValueError, EngineStopped, QueueFull) as error:
            for choice in choices:
                engine.cancel(choice.request)
            if isinstance(error, QueueFull):
                raise
            if isinstance(error, EngineStopped):
                raise ApiError(503, str(error)) from None
            raise ApiError(400, str(error), "prompt") from None
        return choices

    async def run(http: Request, body: Common, prompts: list[list[int]], chat: bool):
        check_model(body.model)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shaped = body.response_format is not None or (chat and body.calls_tools)
        # A grammar's compile goes to a worker thread; a request without one needs no hop there.
        constraint, tool_format = await run_in_threadpool(constraints, body) if shaped else (None, None)
        choices = submit(body, prompts, chat, ident, constraint, tool_format)
        created = int(time.time())
        stops = _stops(body.stop)
        if body.stream:
            usage = (lambda: _usage(prompts, choices)) if body.include_usage else None
            events = _stream(choices, ident, created, chat, stops, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        # Only the first choice listens for the client leaving (one reader of the connection);
        # when it leaves, every choice is cancelled.
        waits = [asyncio.ensure_future(_collect(http if i == 0 else None, choice, chat, stops))
                 for i, choice in enumerate(choices)]
        try:
            answers = await asyncio.gather(*waits)
        except (asyncio.CancelledError, _ClientLeft) as gone:
            if isinstance(gone, _ClientLeft):
                return Response(status_code=499)              # nobody reads it
            raise
        except EngineStopped as error:
            raise ApiError(503, str(error)) from None
        finally:
            for wait in waits:
                wait.cancel()
            for choice in choices:
                engine.cancel(choice.request)
        if chat:
            return {"id": ident, "object": "chat.completion", "created": created, "model": engine.name,
                    "choices": answers, "usage": _usage(prompts, choices)}
        return {"id": ident, "object": "text_completion", "created": created, "model": engine.name,
                "choices": answers, "usage": _usage(prompts, choices)}

    async def _collect(http: Request | None, choice: _Choice, chat: bool, stops: list[str]) -> dict[str, Any]:
        """One choice's whole answer (ApiError 500 where its request failed)."""
        request, text, stopped = choice.request, "", False
        async for piece in _pieces(http, request, choice.pieces):
            text, stopped = _cut_at_stop(text + piece, stops)
            if stopped:
                engine.cancel(request, "stop")
                break
        if not stopped and request.finish_reason == "error":
            raise ApiError(failure_status(), request.error or "the request failed")
        reason = "stop" if stopped else _reason(request.finish_reason)
        logprobs = choice.reported.upto(len(text)) if choice.reported else None
        if chat:
            message = {"role": "assistant", "content": text}
            if choice.tool_format is not None:
                content, calls = tool_calls.parse(text, choice.tool_format)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            return {"index": choice.index, "message": message, "finish_reason": reason, "logprobs": logprobs}
        if choice.echoed:
            text = choice.echoed + text
            if logprobs is not None:
                logprobs = joined(prompt_logprobs(choice), logprobs)
        return {"index": choice.index, "text": text, "finish_reason": reason, "logprobs": logprobs}

    async def _pieces(http: Request | None, request, pieces: asyncio.Queue):
        """A request's text pieces as the engine sends them. While it waits, it checks every
        POLL_S that the engine runs (EngineStopped if not) and, given http, that the client is
        still there (_ClientLeft if not). Streams pass no http: their response listens for the
        disconnect itself, and two readers would take each other's messages."""
        getter: asyncio.Future | None = None
        checked = time.monotonic()
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
                # Pieces may come faster than POLL_S (a fast step): the client is checked every
                # POLL_S all the same, not only when the engine is quiet.
                if http is not None and time.monotonic() - checked >= POLL_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        raise _ClientLeft()
        finally:
            if getter is not None:
                getter.cancel()

    async def _stream(choices: list[_Choice], ident: str, created: int, chat: bool, stops: list[str],
                      usage=None):
        """Server-sent events of every choice as its text comes, each chunk naming its choice's
        index; usage: a function giving the usage, for a last chunk with it
        (stream_options.include_usage). A choice that fails ends the stream with an error event."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> str:
            whole = {"id": ident, "object": kind, "created": created, "model": engine.name,
                     "choices": [choice], **({"usage": None} if usage else {})}
            return f"data: {json.dumps(whole)}\n\n"

        events: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for event in _choice_events(choice, chat, stops):
                    await events.put(("event", event))
                await events.put(("done", None))
            except EngineStopped as error:
                await events.put(("error", _error_body(503, str(error))))
            except _ChoiceFailed as failed:
                await events.put(("error", failed.body))
            except Exception as error:           # whatever it was, the stream ends with it said
                await events.put(("error", _error_body(500, f"{type(error).__name__}: {error}")))

        pumps = []
        try:
            if chat:
                for choice in choices:
                    yield chunk({"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None, "logprobs": None})
            pumps = [asyncio.ensure_future(pump(choice)) for choice in choices]
            running = len(pumps)
            while running:
                what, event = await events.get()
                if what == "done":
                    running -= 1
                elif what == "error":
                    # An error event (OpenAI's clients raise it), then the end, as vLLM ends a stream.
                    yield f"data: {json.dumps(event)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield chunk(event)
            if usage is not None:               # OpenAI's last chunk: no choices, the usage
                last = {"id": ident, "object": kind, "created": created, "model": engine.name, "choices": [],
                        "usage": usage()}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # The client went away (the generator is closed) or the answer is done: either way
            # no request holds a batch line once this returns.
            for running_pump in pumps:
                running_pump.cancel()
            for choice in choices:
                engine.cancel(choice.request)

    async def _choice_events(choice: _Choice, chat: bool, stops: list[str]):
        """One choice's stream: its choice objects, the echoed prompt first (with the first
        token, when its logprobs are there), the finish_reason last. Raises _ChoiceFailed."""
        request, reported = choice.request, choice.reported
        echoing = [choice.echoed] if choice.echoed else []
        # Text that may be a tool call is held back until the end, then sent as tool_calls deltas.
        splitter = tool_calls.StreamSplitter(choice.tool_format) if choice.tool_format is not None else None

        def event(text: str | None, reason: str | None, sent: str = "") -> list[dict[str, Any]]:
            before = []
            if echoing:
                before = [{"index": choice.index, "text": echoing.pop(), "finish_reason": None,
                           "logprobs": prompt_logprobs(choice)}]
            logprobs = reported.upto(len(sent)) if reported else None
            if chat:
                delta = {"content": text} if text else {}
                return before + [{"index": choice.index, "delta": delta, "finish_reason": reason,
                                  "logprobs": logprobs}]
            return before + [{"index": choice.index, "text": text or "", "finish_reason": reason,
                              "logprobs": logprobs}]

        # text: everything received, up to a stop string once one is found; sent: how much of it
        # the client has. The end of text that may begin a stop string waits for what follows.
        text, sent, stopped = "", 0, False
        async for piece in _pieces(None, request, choice.pieces):
            text, stopped = _cut_at_stop(text + piece, stops)
            ready = len(text) if stopped else len(text) - held_back(text, stops)
            if ready > sent:
                new = text[sent:ready] if splitter is None else splitter.feed(text[sent:ready])
                if new:
                    for one in event(new, None, sent=text[:ready]):
                        yield one
                sent = ready
            if stopped:
                engine.cancel(request, "stop")
                break
        if not stopped and request.finish_reason == "error":
            raise _ChoiceFailed(_error_body(failure_status(), request.error or "the request failed"))
        if len(text) > sent:              # held back, and no stop string came: it is text
            new = text[sent:] if splitter is None else splitter.feed(text[sent:])
            if new:
                for one in event(new, None, sent=text):
                    yield one
        reason = "stop" if stopped else _reason(request.finish_reason)
        if splitter is not None:
            rest, calls = splitter.finish()
            if rest:
                for one in event(rest, None, sent=text):
                    yield one
            def call_delta(call: dict[str, Any]) -> dict[str, Any]:
                return {"index": choice.index, "delta": {"tool_calls": [call]}, "finish_reason": None,
                        "logprobs": None}

            for number, call in enumerate(calls):
                function = call["function"]
                yield call_delta({"index": number, "id": call["id"], "type": "function",
                                  "function": {"name": function["name"], "arguments": ""}})
                yield call_delta({"index": number, "function": {"arguments": function["arguments"]}})
            reason = "tool_calls" if calls and reason == "stop" else reason
        for one in event(None, reason, sent=text):
            yield one

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        return await run(http, body, await tokenized(completion_prompts, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatRequest):
        return await run(http, body, await tokenized(lambda b: [chat_prompt(b)], body), chat=True)

    app.include_router(tokenizer_routes(engine, check_model, ApiError))

    def _echo(body: CompletionRequest, index: int, prompt: list[int]) -> str:
        """Prompt `index` as echoed: its text as sent, else its tokens decoded."""
        several = isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list))
        sent = body.prompt[index] if several else body.prompt
        return sent if isinstance(sent, str) else engine.tokenizer.decode(prompt, skip_special_tokens=True)

    def prompt_logprobs(choice: _Choice) -> dict | None:
        """The echoed prompt's logprobs (the answer's first token is there by now: so is the
        whole prompt's)."""
        if choice.reported is None:
            return None
        prompt = choice.prompt
        entries = choice.request.prompt_token_logprobs or [None]
        offsets = Offsets(engine.tokenizer, prompt)
        starts = [offsets.start(i) for i in range(len(prompt))]
        return completion_logprobs(engine.tokenizer, entries, prompt, starts)

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


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once, however many choices it has."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.request.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.request.reused for c in choices)}}


def _reason(finish_reason: str | None) -> str:
    """OpenAI's finish_reason for the batcher's."""
    return {"stop": "stop", "length": "length"}.get(finish_reason or "", "stop")
