"""`pyhlo serve` among other servers and careless clients: a list of bad and extreme requests
each answered with a 4xx in OpenAI's error shape (and none reaching the model), then a right
answer; bodies over the size limit (413); API keys (401); a full waiting queue (429 with
Retry-After); prompts tokenized off the event loop; streams that never show a stop string;
gauges true when idle and the inference gateway's reads; SIGTERM's graceful shutdown.
Every wait is bounded. SmolLM2 on a loopback port, behind pyhlo's own uvicorn server."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import pytest
from server_harness import (
    LINES,
    batched_model,
    free_port,
    openai_client,
    sample_alone,  # noqa: F401  (the fixture `alone`)
    serve,
    serving,
    wait_for,
)

KEY = "sk-pyhlo-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20                   # 1 MiB: the tests' server; pyhlo serve's default is 8 MiB


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    from serving.engine import Engine

    model = batched_model(smollm2_gguf, n_positions=256, context_length_estimate=[32, 64])
    with serving(Engine(model, "smollm2").start(), shutdown_timeout=30, api_key=KEY,
                 max_request_bytes=BODY_LIMIT) as running:
        yield running


@pytest.fixture
def second_engine(served):
    """Another engine over the same model, for a server that a test shuts down. The module's
    engine is idle meanwhile; since the other one writes the same cache lines, the module's
    engine forgets its lines' kept prefixes afterwards."""
    from serving.engine import Engine

    engine = Engine(served.engine.model, "smollm2").start()
    yield engine
    engine.stop()
    assert served.engine.idle()
    served.engine.batcher.kept = [[] for _ in served.engine.batcher.lines]


def api(base: str, key: str = KEY):
    """The openai client, with this module's API key."""
    return openai_client(base, api_key=key)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH, timeout=30).text
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, (name, text)
    return float(values[0])


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), body
    return error


# -- a list of bad and extreme requests ----------------------------------------------------
COMPLETION = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
USER = {"role": "user", "content": "Hello"}

# (field, value) wrong in a completion and in a chat completion alike.
BAD_COMMON_FIELDS = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", -10**12), ("max_tokens", "ten"),
    ("max_tokens", 1.5), ("max_tokens", [4]), ("max_tokens", {"n": 4}), ("max_tokens", 300),
    ("max_tokens", 10**12), ("max_tokens", 10**40), ("max_completion_tokens", 0),
    ("max_completion_tokens", -3),
    ("max_completion_tokens", "x"), ("max_completion_tokens", 10**9),
    ("temperature", -0.01), ("temperature", -1e30), ("temperature", "hot"), ("temperature", [1]),
    ("temperature", {"t": 1}), ("temperature", "NaN"), ("temperature", "inf"), ("temperature", "-inf"),
    ("top_p", 0), ("top_p", -0.5), ("top_p", 1.0001), ("top_p", 2), ("top_p", "x"), ("top_p", [0.5]),
    ("top_p", "nan"), ("top_k", -2), ("top_k", -100), ("top_k", 1.5), ("top_k", "many"), ("top_k", [1]),
    ("seed", "abc"), ("seed", 1.5), ("seed", [1]), ("seed", {"s": 1}), ("seed", 2**64), ("seed", -2**63 - 1),
    ("seed", 10**30), ("stop", 5), ("stop", [1, 2]), ("stop", {"s": "x"}), ("stop", [None]), ("stop", True),
    ("stop", "\ud800"), ("stream", "maybe"), ("stream", 2), ("stream", [True]), ("stream", {"on": 1}),
    ("model", "gpt-9"), ("model", "smollm3"), ("model", 123), ("model", ["smollm2"]), ("model", "\udfff"),
    ("n", 0), ("n", -1), ("n", "two"), ("n", 1.5), ("user", "\udc00"),
]

BAD_COMPLETIONS = [
    {}, {"max_tokens": 4}, {"prompt": None}, {"prompt": 5}, {"prompt": 1.5}, {"prompt": True},
    {"prompt": {"text": "Hello"}}, {"prompt": []}, {"prompt": ""}, {"prompt": [-1]}, {"prompt": [10**9]},
    {"prompt": [2**40]}, {"prompt": [1.5]}, {"prompt": ["a", 1]}, {"prompt": [None]}, {"prompt": [[]]},
    {"prompt": "word " * 400}, {"prompt": list(range(300))}, {"prompt": "\ud800"}, {"prompt": "ok \udfff"},
    {"prompt": ["\ud800"]}, {"prompt": "a\ud83d"}, {"messages": [USER]},
]

BAD_CHATS = [
    {}, {"max_tokens": 4}, {"prompt": "Hello"}, {"messages": None}, {"messages": "Hello"}, {"messages": USER},
    {"messages": []}, {"messages": [{}]}, {"messages": [None]}, {"messages": ["Hello"]}, {"messages": [[]]},
    {"messages": [{"content": "Hello"}]}, {"messages": [{"role": "wizard", "content": "Hello"}]},
    {"messages": [{"role": "USER", "content": "Hello"}]}, {"messages": [{"role": "", "content": "Hello"}]},
    {"messages": [{"role": 5, "content": "Hello"}]}, {"messages": [{"role": None, "content": "Hello"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": {"t": 1}}]},
    {"messages": [{"role": "user", "content": True}]}, {"messages": [USER, "Hello"]},
    {"messages": [USER, {"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": "word " * 400}]}, {"messages": [USER] * 200},
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": [{"role": "user", "content": "a\udbff"}]},
    {"messages": [{"role": "\ud800", "content": "Hello"}]},
    {"messages": [USER, {"role": "assistant", "content": "\udfff Hi"}]},
]

# Bodies that are not JSON objects, or not JSON at all, sent as they are.
RAW_BODIES = [
    b"", b"{", b"{not json", b"{'prompt': 'Hello'}", b'{"prompt": "Hello",}', b'{"prompt": "Hello"',
    b"[1, 2", b'{"prompt": "\xff\xfe"}', b'{"prompt": "Hello", "temperature": Infinity}',
    b'{"prompt": "Hello", "temperature": -Infinity}', b'{"prompt": "Hello", "temperature": NaN}',
    b'{"prompt": "Hello", "top_p": 1e400}', b"null", b"[]", b'"just a string"', b"123", b"true",
    b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
]

WRONG_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "application/xml", "text/html"]


def bad_requests() -> list[tuple[str, str, dict, int]]:
    """(method, path, httpx.request options, the status expected)."""
    cases = []
    for path, good in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for field, value in BAD_COMMON_FIELDS:
            status = 404 if field == "model" and isinstance(value, str) and value.isascii() else 400
            cases.append(("POST", path, {"json": {**good, field: value}}, status))
        as_json = {"Content-Type": "application/json"}
        cases += [("POST", path, {"content": raw, "headers": as_json}, 400) for raw in RAW_BODIES]
        cases += [("POST", path, {"content": json.dumps(good), "headers": {"Content-Type": kind}}, 400)
                  for kind in WRONG_CONTENT_TYPES]
        cases.append(("POST", path, {"content": b"x" * (BODY_LIMIT + 1), "headers": as_json}, 413))
        cases.append(("GET", path, {}, 405))
        cases.append(("PUT", path, {"json": good}, 405))
    for path, bodies in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHATS)):
        cases += [("POST", path, {"json": {"max_tokens": 4, **body} if body else body}, 400)
                  for body in bodies]
    cases += [("DELETE", "/v1/models", {}, 405), ("POST", "/v1/models", {"json": {}}, 405),
              ("GET", "/v1/nothing", {}, 404),
              ("POST", "/v1/engines/smollm2/completions", {"json": COMPLETION}, 404),
              ("GET", "/docs", {}, 404), ("GET", "/openapi.json", {}, 404), ("GET", "/redoc", {}, 404)]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        for header in (None, "Bearer wrong-key", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", f"Token {KEY}",
                       f"Bearer {KEY[:-1]}"):
            headers = {"Authorization": header} if header is not None else {}
            cases.append(("GET" if path == "/v1/models" else "POST", path,
                          {"json": COMPLETION, "headers": headers, "auth_given": True}, 401))
    return cases


BAD_REQUESTS = bad_requests()


def test_the_list_holds_at_least_150_distinct_bad_requests():
    distinct = {json.dumps([m, p, {k: (v if not isinstance(v, bytes) else v.decode("latin-1"))
                                   for k, v in options.items()}], sort_keys=True, default=repr)
                for m, p, options, _ in BAD_REQUESTS}
    assert len(distinct) == len(BAD_REQUESTS) >= 150, len(distinct)


@pytest.mark.parametrize("method,path,options,status", BAD_REQUESTS,
                         ids=[f"{i}-{m}-{p}-{s}" for i, (m, p, _, s) in enumerate(BAD_REQUESTS)])
def test_a_bad_request_gets_a_4xx_in_openais_shape_and_never_reaches_the_model(served, method, path, options,
                                                                                status):
    options = dict(options)
    headers = {**({} if options.pop("auth_given", False) else AUTH), **options.pop("headers", {})}
    if "json" in options:         # escaped as JSON allows (httpx's own encoding refuses lone surrogates)
        options["content"] = json.dumps(options.pop("json")).encode()
        headers.setdefault("Content-Type", "application/json")
    engine = served.engine
    before = engine.prompt_tokens._value.get()
    with httpx.Client(base_url=served.base, timeout=30) as http:
        response = http.request(method, path, headers=headers, **options)
    error = assert_openai_error(response, status)
    if status == 400 and "context" in error["message"]:
        assert error["code"] == "context_length_exceeded"
    if status == 401:
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    assert engine.prompt_tokens._value.get() == before, "a bad request reached the model"


def test_after_every_bad_request_the_server_answers_right_and_is_idle(served, alone):
    model, text = alone
    prompt = "The capital of France is"
    done = api(served.base).completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text == text(list(model.tokenizer(prompt)["input_ids"]), 8)
    assert httpx.get(served.base + "/health", timeout=30).json() == {"status": "ok"}      # no key needed
    assert metric(served.base, "pyhlo_waiting_requests") == 0 and metric(served.base, "pyhlo_busy_lines") == 0


def test_extreme_but_valid_values_answer(served):
    """Values at the edges of what is allowed are served, not refused."""
    bodies = [{"max_tokens": 1}, {"top_k": 10**9}, {"top_p": 1e-300}, {"seed": 2**63 - 1}, {"seed": -2**63},
              {"temperature": 1e308}, {"stop": ["\U0001F600", "\n\n\n"]}, {"prompt": "\U0001F600 " * 3},
              {"prompt": [0]}, {"prompt": "word " * 200, "max_tokens": 2}]
    with httpx.Client(base_url=served.base, headers=AUTH, timeout=60) as http:
        for body in bodies:
            response = http.post("/v1/completions", json={**COMPLETION, **body})
            assert response.status_code == 200, (body, response.text)
            assert response.json()["choices"][0]["finish_reason"] in ("length", "stop"), body
        # A surrogate pair escaped in JSON is one character (an emoji), valid Unicode.
        pair = http.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}',
                         headers={"Content-Type": "application/json"})
        assert pair.status_code == 200, pair.text


# -- size, keys, docs ----------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_declared_or_chunked_and_the_server_keeps_answering(served):
    big = json.dumps({"prompt": "word " * (BODY_LIMIT // 4)}).encode()

    def chunks():                     # no Content-Length: the limit counts the bytes as they come
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    with httpx.Client(base_url=served.base, headers=AUTH, timeout=60) as http:
        for content in (big, chunks()):
            response = http.post("/v1/completions", content=content,
                                 headers={"Content-Type": "application/json"})
            error = assert_openai_error(response, 413)
            assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
        ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_the_api_key_guards_every_route_but_health_and_metrics(served):
    import openai

    with pytest.raises(openai.AuthenticationError):
        api(served.base, key="wrong").models.list()
    assert api(served.base).models.list().data[0].id == "smollm2"
    assert httpx.get(served.base + "/health", timeout=30).status_code == 200
    lower = httpx.get(served.base + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30)
    assert lower.status_code == 200                                 # the scheme is case-insensitive
    assert httpx.get(served.base + "/metrics", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(served.base + "/metrics", timeout=30).status_code == 200   # scrapers send no key


def test_docs_are_served_only_when_asked(served):
    from serving.openai_api import create_app

    async def get(app, path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pyhlo") as http:
            return (await http.get(path)).status_code

    shown = create_app(served.engine, docs=True)
    hidden = create_app(served.engine)
    assert asyncio.run(get(shown, "/docs")) == 200 and asyncio.run(get(shown, "/openapi.json")) == 200
    assert asyncio.run(get(hidden, "/docs")) == 404 and asyncio.run(get(hidden, "/openapi.json")) == 404


def test_pyhlo_serve_options_and_their_defaults(monkeypatch):
    from test_server import serve_args

    monkeypatch.delenv("PYHLO_API_KEY", raising=False)
    args = serve_args()
    assert (args.api_key, args.max_waiting, args.max_request_bytes, args.shutdown_timeout, args.enable_docs) \
        == (None, None, 8 * 1024 * 1024, 30.0, False)
    args = serve_args("--api-key", "k", "--max-waiting", "16", "--max-request-bytes", "1000",
                      "--shutdown-timeout", "5", "--enable-docs")
    assert (args.api_key, args.max_waiting, args.max_request_bytes, args.shutdown_timeout, args.enable_docs) \
        == ("k", 16, 1000, 5.0, True)
    monkeypatch.setenv("PYHLO_API_KEY", "from-the-environment")     # as vLLM reads VLLM_API_KEY
    assert serve_args().api_key == "from-the-environment"
    assert serve_args("--api-key", "given").api_key == "given"


# -- the event loop, stop strings ------------------------------------------------------------
class _HeldTokenizer:
    """The engine's tokenizer, except that a text holding `marker` waits (in whatever thread
    tokenizes it) until `release` is set."""

    def __init__(self, real, marker: str):
        self.real, self.marker = real, marker
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: set[int] = set()

    def _hold(self, text: str) -> None:
        self.threads.add(threading.get_ident())
        if self.marker in text:
            self.entered.set()
            assert self.release.wait(timeout=60), "never released"

    def __call__(self, text, *args, **kwargs):
        self._hold(text)
        return self.real(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self._hold(json.dumps(messages))
        return self.real.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_tokenizing_runs_off_the_event_loop(served, monkeypatch, chat):
    """While one request's prompt is being tokenized (held here until the other is answered),
    another request is served from start to end: the event loop never waits for a tokenizer."""
    held = _HeldTokenizer(served.engine.tokenizer, "HOLD-ME")
    monkeypatch.setattr(served.engine, "tokenizer", held)
    path, slow = (("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "HOLD-ME"}]})
                  if chat else ("/v1/completions", {**COMPLETION, "prompt": "HOLD-ME"}))
    quick = CHAT if chat else COMPLETION

    async def both():
        async with httpx.AsyncClient(base_url=served.base, headers=AUTH, timeout=60) as http:
            waiting = asyncio.create_task(http.post(path, json=slow))
            for _ in range(3000):
                if held.entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert held.entered.is_set(), "the held prompt was never tokenized"
            answered = await asyncio.wait_for(http.post(path, json=quick), timeout=60)
            released_before = held.release.is_set()
            held.release.set()
            return answered, released_before, await asyncio.wait_for(waiting, timeout=60)

    try:
        answered, released_before, slow_answer = asyncio.run(both())
    finally:
        held.release.set()
    assert answered.status_code == 200 and not released_before
    assert slow_answer.status_code == 200
    assert served.thread.ident not in held.threads


def stream_text(base: str, path: str, body: dict) -> tuple[list[str], str | None]:
    pieces, reason = [], None
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:
        with http.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        choice = json.loads(event)["choices"][0]
        pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        reason = choice["finish_reason"] or reason
    return pieces, reason


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_never_shows_any_part_of_a_stop_string(served, chat):
    """A stop string of several tokens: the streamed pieces join to the text cut before it, the
    non-streamed text, with no piece of it sent first; a stop string that begins but never
    completes is text after all."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = ({"messages": [{"role": "user", "content": "Write two sentences about the sea."}]} if chat
            else {"prompt": "1, 2, 3, 4,"})
    body = {**body, "max_tokens": 40, "temperature": 0}

    def whole(extra: dict) -> dict:
        response = httpx.post(served.base + path, json={**body, **extra}, headers=AUTH, timeout=60)
        assert response.status_code == 200
        choice = response.json()["choices"][0]
        return {"text": choice["message"]["content"] if chat else choice["text"],
                "finish_reason": choice["finish_reason"]}

    full = whole({})["text"]
    words = full.split(" ")
    assert len(words) >= 6, full
    middle = len(words) // 2
    stop = " " + words[middle] + " " + words[middle + 1]       # two words: several tokens, mid-answer
    assert stop in full, (full, stop)
    expected = full[:full.index(stop)]
    pieces, reason = stream_text(served.base, path, {**body, "stop": [stop]})
    assert "".join(pieces) == expected == whole({"stop": [stop]})["text"] and reason == "stop"
    never = stop[:len(stop) // 2 + 1] + "\u2603"            # begins like the text, never completes
    pieces, reason = stream_text(served.base, path, {**body, "stop": [never]})
    assert "".join(pieces) == full and reason == whole({})["finish_reason"]


# -- load: gauges, the queue's bound ---------------------------------------------------------
def test_gauges_are_zero_once_requests_finish(served):
    """Twelve one-token requests over four lines: some wait, and each ends in the step that
    admits it. Once they are done, every gauge reads 0."""
    async def everyone():
        async with httpx.AsyncClient(base_url=served.base, headers=AUTH, timeout=120) as http:
            asked = [http.post("/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 1})
                     for i in range(12)]
            return await asyncio.wait_for(asyncio.gather(*asked), timeout=300)

    assert all(response.status_code == 200 for response in asyncio.run(everyone()))
    wait_for(served.engine.idle, "the engine idle")
    for name in ("pyhlo_waiting_requests", "pyhlo_running_requests", "pyhlo_busy_lines",
                 "pyhlo_kv_cache_usage_ratio"):
        assert metric(served.base, name) == 0, name
    assert metric(served.base, "pyhlo_lines") == LINES


def test_a_full_queue_is_a_429_with_retry_after_and_the_gauges_follow_the_load(served, monkeypatch):
    """Four long streams fill the lines and one request waits (max_waiting 1): the next gets a
    429 with Retry-After, and /metrics reads 4 running, 1 waiting, the KV cache all in use."""
    import openai

    engine = served.engine
    monkeypatch.setattr(engine, "max_waiting", None)          # restored to this after the test
    body = {"max_tokens": 200, "temperature": 0, "stream": True}

    async def load():
        async with httpx.AsyncClient(base_url=served.base, headers=AUTH, timeout=120) as http:
            async def hold(i: int, started: asyncio.Event, leave: asyncio.Event):
                async with http.stream("POST", "/v1/completions",
                                       json={**body, "prompt": f"Story {i}:"}) as response:
                    assert response.status_code == 200
                    started.set()
                    await leave.wait()             # leaves: the connection closes, the request ends

            leave = asyncio.Event()
            events = [asyncio.Event() for _ in range(LINES + 1)]
            streams = [asyncio.create_task(hold(i, events[i], leave)) for i in range(LINES + 1)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=120)
            for _ in range(6000):
                if engine.batcher.active == LINES and engine.waiting_requests() == 1:
                    break
                await asyncio.sleep(0.01)
            engine.max_waiting = 1
            full = await http.post("/v1/completions", json={"prompt": "One more", "max_tokens": 2})
            readings = {name: metric(served.base, name) for name in
                        ("pyhlo_running_requests", "pyhlo_waiting_requests", "pyhlo_kv_cache_usage_ratio")}
            leave.set()
            await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
            return full, readings

    full, readings = asyncio.run(load())
    error = assert_openai_error(full, 429)
    assert full.headers["retry-after"] == "1" and error["code"] == "queue_full" and "--max-waiting" in \
        error["message"]
    assert readings == {"pyhlo_running_requests": LINES, "pyhlo_waiting_requests": 1,
                        "pyhlo_kv_cache_usage_ratio": 1.0}
    wait_for(engine.idle, "the engine idle once the clients left")
    engine.max_waiting = 0
    with pytest.raises(openai.RateLimitError):           # what the openai client makes of it
        api(served.base).completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    engine.max_waiting = 1
    assert api(served.base).completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text


# -- SIGTERM -------------------------------------------------------------------------------
def _stream_all(http: httpx.Client, prompt: str, max_tokens: int) -> tuple[str, str | None, dict | None]:
    """A streamed completion: its text, its finish_reason, and its error event if any."""
    text, reason, error = "", None, None
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    text += event["choices"][0]["text"]
                    reason = event["choices"][0]["finish_reason"] or reason
    return text, reason, error


class _HeldSteps:
    """Holds an engine's thread before a step once `when()` is true there, until release().
    The thread that steps reads `when` between two steps, so the state it waits for cannot
    pass unseen however slow the machine, and it lasts while a test acts on it. Bounded:
    the thread goes on by itself after `seconds`."""

    def __init__(self, engine, when, seconds: float = 300):
        self.reached = threading.Event()
        self._released = threading.Event()
        self._batcher = engine.batcher
        step = engine.batcher.step

        def held_step():
            if not self._released.is_set() and when():
                self.reached.set()
                self._released.wait(timeout=seconds)
            step()

        self._batcher.step = held_step

    def release(self) -> None:
        self._released.set()
        del self._batcher.step                  # the batcher's own step again


@contextlib.contextmanager
def _load(base: str, engine, prompts: list[str], waiting: int, max_tokens: int):
    """len(prompts) streams and `waiting` plain requests after them, in threads. Inside the
    block the engine is held between two steps with every stream generating and the others
    submitted and in no line; leaving the block lets it step again. Yields (results: filled
    as the requests end, the threads, an http client)."""
    results: dict = {}

    def stream(i):
        with httpx.Client(base_url=base, timeout=120) as http:
            try:
                results[i] = _stream_all(http, prompts[i], max_tokens)
            except httpx.HTTPError as error:            # the server went away mid-answer
                results[i] = error

    def plain(i):
        with httpx.Client(base_url=base, timeout=120) as http:
            try:
                results[f"waiting-{i}"] = http.post("/v1/completions",
                                                    json={"prompt": f"Later {i}", "max_tokens": 4})
            except httpx.HTTPError as error:
                results[f"waiting-{i}"] = error

    # A request that finds a free line is admitted in the next step: "waiting" lasts less than
    # a step unless the engine is held, and polling for it from here would miss it.
    held = _HeldSteps(engine, when=lambda: sum(r is not None and len(r.tokens) > 1
                                               for r in engine.batcher.lines) == len(prompts))
    http = httpx.Client(base_url=base, timeout=60)
    try:
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        assert held.reached.wait(timeout=60), "every line generating: not within 60 s"
        threads += [threading.Thread(target=plain, args=(i,), daemon=True) for i in range(waiting)]
        for thread in threads[len(prompts):]:
            thread.start()
        wait_for(lambda: engine.waiting_requests() == waiting, "the others waiting")
        yield results, threads, http
    finally:
        held.release()
        http.close()


def test_sigterm_lets_running_requests_finish_fails_waiting_ones_and_refuses_new_ones(served, second_engine,
                                                                                      alone):
    model, text = alone
    running = serve(second_engine, shutdown_timeout=120)
    prompts = [f"Here is a long story about {thing}:" for thing in ("a fox", "a ship", "a town", "a bell")]
    with _load(running.base, second_engine, prompts, waiting=2, max_tokens=48) as (results, threads, http):
        running.server.handle_exit(signal.SIGTERM, None)
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        health = http.get("/health")
    for thread in threads:
        thread.join(timeout=120)
    running.thread.join(timeout=60)
    assert not running.thread.is_alive(), "the server did not exit once its requests were done"
    for response in (refused, health):
        assert "shutting down" in assert_openai_error(response, 503)["message"]
    for i in range(2):
        error = assert_openai_error(results[f"waiting-{i}"], 503)
        assert "shutting down" in error["message"] and "waiting" in error["message"]
    for i, prompt in enumerate(prompts):
        assert results[i] == (text(list(model.tokenizer(prompt)["input_ids"]), 48), "length", None), prompt


def test_sigterm_ends_what_still_runs_at_the_timeout_and_a_second_signal_exits_at_once(served,
                                                                                      second_engine):
    from serving.engine import Engine

    # --shutdown-timeout 0: the running requests end with an error at once, as a 503.
    running = serve(second_engine, shutdown_timeout=0)
    prompts = [f"Count slowly, {thing}:" for thing in ("one", "two")]
    with _load(running.base, second_engine, prompts, waiting=0, max_tokens=200) as (results, threads, _):
        running.server.handle_exit(signal.SIGTERM, None)
    for thread in threads:
        thread.join(timeout=120)
    running.thread.join(timeout=60)
    assert not running.thread.is_alive()
    for i in range(len(prompts)):
        _, reason, error = results[i]
        assert reason is None and "--shutdown-timeout" in error["message"], results[i]
    second_engine.stop()

    # A long timeout, and a second signal: the server goes at once, ending its requests.
    third = Engine(served.engine.model, "smollm2").start()
    try:
        running = serve(third, shutdown_timeout=600)
        with _load(running.base, third, prompts, waiting=1, max_tokens=200) as (_, threads, _):
            with third._open_lock:
                held = list(third._open.values())
            assert len(held) == len(prompts) + 1
            running.server.handle_exit(signal.SIGTERM, None)
            running.server.handle_exit(signal.SIGTERM, None)
        running.thread.join(timeout=60)
        assert not running.thread.is_alive(), "a second signal did not stop the server"
        wait_for(third.idle, "every request ended")
        for thread in threads:
            thread.join(timeout=60)
        for request in held:
            # The first signal's drain ends the waiting one; the second, the running ones.
            if request.line is None:
                assert request.finish_reason == "error" and "shutting down" in request.error and \
                    "waiting" in request.error, request.error
            else:
                assert request.finish_reason == "error" and "stopped" in request.error, request.error
            assert len(request.tokens) < 200
    finally:
        third.stop()


def test_the_engine_is_not_idle_while_its_thread_takes_a_request_in(second_engine):
    """Between the inbox and the batcher's queue a request is in neither: a graceful shutdown
    reading idle() at that moment would exit under it."""
    from serving.engine import Sampling

    engine, seen = second_engine, []
    add = engine.batcher.add

    def add_and_look(request):
        seen.append(engine.idle())               # on the engine thread, the request taken from the inbox
        add(request)

    engine.batcher.add = add_and_look
    loop = asyncio.new_event_loop()              # the request's text goes to its queue, unread
    try:
        request, _ = engine.submit([1, 2, 3], Sampling(max_tokens=2), loop)
        wait_for(lambda: request.done, "the request ended")
    finally:
        loop.close()
    assert seen == [False] and request.finish_reason in ("length", "stop")
    wait_for(engine.idle, "the engine idle once the request ended", seconds=10)


def test_pyhlo_serve_drains_on_a_real_sigterm_and_exits(smollm2_gguf, served):
    """The command itself: SIGTERM mid-answer; the stream finishes whole, a new request is
    refused, and the process exits. (The module's server ran first: the programs for these
    shapes come from the compile cache.)"""
    import os
    import subprocess
    import sys

    port = free_port()
    command = [sys.executable, "-m", "tools", "serve", "-m", str(smollm2_gguf), "--max-num-seqs", str(LINES),
               "--max-model-len", "256", "--context-length-estimate", "32,64", "--port", str(port),
               "--shutdown-timeout", "120", "--no-request-log"]
    environment = {k: v for k, v in os.environ.items() if k != "PYHLO_API_KEY"}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "pyhlo serve did not start in 300 s"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        events, first = [], threading.Event()

        def stream():
            body = {"prompt": "Here is a long story about a fox:", "max_tokens": 60, "temperature": 0,
                    "stream": True}
            with httpx.Client(base_url=base, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(timeout=120), "no first chunk in 120 s"
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:                             # the signal is taken between two bytecodes: soon
            refused = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            if refused.status_code != 200 or time.monotonic() > deadline:
                break
        assert "shutting down" in assert_openai_error(refused, 503)["message"]
        reader.join(timeout=120)
        assert process.wait(timeout=120) is not None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])
    assert len("".join(c["text"] for c in chunks)) > 0


def test_pyhlo_serve_compiles_short_prompt_chunks_unless_told(monkeypatch):
    """A chat request past the prefix its line keeps is often a few dozen tokens: it runs as a
    16- or 32-token chunk, not as half the smallest token bucket."""
    from test_server import serve_args

    from tools import serve

    built = {}

    class Stop(Exception):
        pass

    def from_pretrained(path, **options):
        built.update(options)
        raise Stop

    monkeypatch.setattr("decoders.NeuronAutoModelForCausalLM.from_pretrained", from_pretrained)
    for argv, chunks in ((("--n-positions", "1024"), [8, 16, 32, 64, 128, 256, 512]),
                         (("--n-positions", "128"), [8, 16, 32, 64]),
                         (("--n-positions", "1024", "--context-length-estimate", "64,256"), [64, 256])):
        with pytest.raises(Stop):
            serve.build_engine(serve_args("some-model-dir", *argv))
        assert built["context_length_estimate"] == chunks, argv
