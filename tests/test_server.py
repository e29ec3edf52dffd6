"""`pyhlo serve`'s OpenAI-compatible API on SmolLM2, started on a free loopback port: the
official openai client, streaming, concurrent clients getting what sample() gives each
prompt alone, errors in OpenAI's shape, and clients that go away freeing their lines.
Every wait here is bounded."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import httpx
import pytest
from server_harness import (
    LINES,
    async_openai_client,
    batched_model,
    openai_client,
    sample_alone,  # noqa: F401  (the fixture `alone`)
    serving,
    wait_for,
)


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    from serving.engine import Engine

    model = batched_model(smollm2_gguf, n_positions=256, context_length_estimate=[32, 64])
    with serving(Engine(model, "smollm2").start()) as running:
        yield running.base, running.engine


def chat_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_openai_client_gets_a_completion_and_a_streamed_chat_completion(server, alone):
    base, _ = server
    model, text = alone
    api = openai_client(base)
    done = api.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    prompt_ids = list(model.tokenizer("The capital of France is")["input_ids"])
    assert done.choices[0].text == text(prompt_ids, 12)
    assert done.usage.prompt_tokens == len(prompt_ids) and done.usage.completion_tokens == 12
    assert done.choices[0].finish_reason == "length"

    question = "What is the capital of France?"
    stream = api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                         max_tokens=40, temperature=0, stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    answer = "".join(pieces)
    assert answer == text(chat_ids(model.tokenizer, question), 40)
    assert "Paris" in answer and reasons[-1] in ("stop", "length")
    whole = api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                        max_tokens=40, temperature=0)
    assert whole.choices[0].message.content == answer


def test_sixteen_concurrent_streams_each_get_what_sample_gives_their_prompt_alone(server, alone):
    base, engine = server
    model, text = alone
    topics = ["the sea", "a cat", "winter", "coffee", "the moon", "trains", "music", "bread", "rain",
              "a garden", "mountains", "a library", "fire", "the desert", "bees", "a clock"]
    questions = [f"Write one sentence about {topic}." for topic in topics]
    api = async_openai_client(base)

    async def one(question: str) -> str:
        stream = await api.chat.completions.create(model="smollm2",
                                                   messages=[{"role": "user", "content": question}],
                                                   max_tokens=24, temperature=0, stream=True)
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])

    async def everyone():
        return await asyncio.wait_for(asyncio.gather(*(one(q) for q in questions)), timeout=300)

    steps_before = engine.batcher.steps
    answers = asyncio.run(everyone())
    for question, answer in zip(questions, answers):
        assert answer == text(chat_ids(model.tokenizer, question), 24), question
    # Requests shared steps: 16 answers of up to 24 tokens took far fewer than 16 * 24 steps.
    assert engine.batcher.steps - steps_before < 16 * 24 / 2


def test_bad_requests_get_4xx_in_openais_shape_and_the_server_keeps_answering(server):
    base, _ = server
    with httpx.Client(base_url=base, timeout=30) as http:
        cases = [
            ({"prompt": "word " * 400, "max_tokens": 4}, 400, "context_length_exceeded"),
            ({"prompt": "hello", "max_tokens": 300}, 400, "context_length_exceeded"),
            ({"prompt": "hello", "model": "gpt-9"}, 404, "model_not_found"),
            ({"prompt": "hello", "temperature": -1}, 400, None),
            ({"prompt": "hello", "n": 0}, 400, None),
            ({"max_tokens": 4}, 400, None),
            ({"prompt": [999999], "max_tokens": 4}, 400, None),
        ]
        for body, status, code in cases:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error" and error["code"] == code
        broken = http.post("/v1/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        no_messages = http.post("/v1/chat/completions", json={"messages": []})
        assert no_messages.status_code == 400
        assert http.get("/health").json() == {"status": "ok"}
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == "smollm2" and models["data"][0]["max_model_len"] == 256
        ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_stop_strings_and_seeds(server):
    base, _ = server
    api = openai_client(base)
    whole = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20,
                                   temperature=0).choices[0].text
    stop = whole.strip().split(",")[1].strip()             # a number the answer goes on to write
    cut = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                 stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [api.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=16,
                                      temperature=1.0, top_p=0.95, seed=seed,
                                      extra_body={"top_k": 40}).choices[0].text for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_fifty_clients_a_quarter_leaving_mid_stream_leave_no_line_in_use(server):
    base, engine = server

    async def one(i: int, http: httpx.AsyncClient) -> int:
        body = {"prompt": f"Story number {i}:", "max_tokens": 32, "temperature": 0, "stream": True}
        received = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
                    received += 1
                    if i % 4 == 0 and received == 2:
                        return received            # leaves: the connection is closed mid-stream
        return received

    async def everyone():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(i, http) for i in range(50))), timeout=400)

    received = asyncio.run(everyone())
    assert all(count >= 2 for count in received)
    wait_for(engine.idle, "every line free once every client finished or left", seconds=60)
    assert engine.batcher.active == 0 and not engine.batcher.waiting
    with httpx.Client(base_url=base, timeout=30) as http:
        metrics = http.get("/metrics").text
        assert "pyhlo_busy_lines 0.0" in metrics
        assert 'pyhlo_requests_total{finish_reason="cancelled"}' in metrics
        assert "pyhlo_time_to_first_token_seconds_count" in metrics
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def serve_args(*argv: str) -> argparse.Namespace:
    from tools import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_takes_the_spellings_vllm_and_llama_cpp_users_type():
    from tools.serve import model_path

    for argv in (["m.gguf"], ["-m", "m.gguf"], ["--model", "m.gguf"], ["m.gguf", "--model", "m.gguf"]):
        assert model_path(serve_args(*argv)) == "m.gguf"
    assert model_path(serve_args()) is None                     # the default model
    with pytest.raises(ValueError, match="two models"):
        model_path(serve_args("a.gguf", "-m", "b.gguf"))
    args = serve_args("--max-num-seqs", "8", "--max-model-len", "512", "--dtype", "bf16", "--tp-degree", "2")
    assert (args.batch_size, args.n_positions, args.amp, args.tp_degree) == (8, 512, "bf16", 2)
    assert serve_args("--dtype", "bfloat16").amp == "bf16"       # torch's names, as vLLM takes them
    args = serve_args("--batch-size", "8", "--n-positions", "512", "--amp", "bf16")
    assert (args.batch_size, args.n_positions, args.amp, args.tp_degree) == (8, 512, "bf16", 1)
    assert not serve_args().no_request_log and serve_args("--no-request-log").no_request_log


def test_serve_says_what_it_is_doing_while_it_starts(smollm2_gguf, capsys):
    """A line per start-up step (each can take seconds), without -v."""
    from tools.serve import build_engine

    # The server fixture's shapes: its programs come from the compile cache.
    args = serve_args("-m", str(smollm2_gguf), "--max-num-seqs", str(LINES), "--max-model-len", "256",
                      "--context-length-estimate", "32,64")
    engine = build_engine(args)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pyhlo serve: ")]
    programs = len(engine.model.eager_programs())
    assert said == [f"pyhlo serve: reading {smollm2_gguf} ...",
                    f"pyhlo serve: compiling {programs} programs (from the compile cache when built before) "
                    "...", "pyhlo serve: placing the weights ...", "pyhlo serve: loading the tokenizer ..."]
    assert engine.model.session.loaded and engine.name == smollm2_gguf.name and engine.n_positions == 256


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_each_finished_request_gives_one_log_line_unless_quieted(server):
    from serving.engine import request_log, show_request_log

    base, _ = server
    api = openai_client(base)
    lines = _Lines()
    request_log.addHandler(lines)
    try:
        show_request_log(True)
        done = api.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
        cut = api.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                     stop=[","])
        deadline = time.monotonic() + 10          # the stopped request's line comes once the engine ends it
        while len(lines.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lines.lines) == 2
        logged = [(line.split()[0], dict(field.split("=") for field in line.split()[1:]))
                  for line in lines.lines]
        for (ident, values), response in zip(logged, (done, cut)):
            assert ident == response.id and values["finish_reason"] == response.choices[0].finish_reason
            assert int(values["prompt_tokens"]) == response.usage.prompt_tokens
            assert float(values["time"].removesuffix("s")) > 0
        assert logged[0][1]["finish_reason"] == "length" and logged[1][1]["finish_reason"] == "stop"
        assert int(logged[0][1]["completion_tokens"]) == done.usage.completion_tokens == 3
        show_request_log(False)                                  # pyhlo serve --no-request-log
        api.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
        assert len(lines.lines) == 2
    finally:
        request_log.removeHandler(lines)
        request_log.setLevel(logging.NOTSET)


def test_one_request_failing_inside_a_step_ends_alone_and_seven_others_get_their_solo_text(server, alone,
                                                                                            monkeypatch):
    """Fault injection: of 8 concurrent greedy requests, one fails while its tokens are chosen
    (mid-answer). It gets a 500 in OpenAI's shape; the 7 others, streamed or not, get what
    sample() gives their prompts alone."""
    base, engine = server
    model, text = alone
    prompts = [f"Here is a short list of {thing}:" for thing in
               ("fruits", "colours", "rivers", "tools", "birds", "games", "metals", "planets")]
    doomed = list(model.tokenizer(prompts[3])["input_ids"])
    choose = engine.batcher._choose

    def failing_choice(request, logits):
        if request.prompt == doomed and len(request.tokens) == 4:
            raise RuntimeError("injected fault")
        return choose(request, logits)

    monkeypatch.setattr(engine.batcher, "_choose", failing_choice)
    api = async_openai_client(base)

    async def one(i: int, http: httpx.AsyncClient):
        if i == 3:
            return await http.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 20,
                                                             "temperature": 0})
        if i % 2:
            done = await api.completions.create(model="smollm2", prompt=prompts[i], max_tokens=20,
                                                temperature=0)
            return done.choices[0].text, done.choices[0].finish_reason
        stream = await api.completions.create(model="smollm2", prompt=prompts[i], max_tokens=20,
                                              temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def everyone():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(i, http) for i in range(8))), timeout=300)

    answers = asyncio.run(everyone())
    failed = answers[3]
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    for i, answer in enumerate(answers):
        if i != 3:
            ids = list(model.tokenizer(prompts[i])["input_ids"])
            assert answer == (text(ids, 20), "length"), prompts[i]
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert 'pyhlo_requests_total{finish_reason="error"} 1.0' in metrics


def test_a_streamed_request_that_fails_gets_an_error_event_and_the_stream_ends(server, monkeypatch):
    import openai

    base, engine = server
    choose = engine.batcher._choose

    def failing_choice(request, logits):
        if len(request.tokens) == 2:
            raise RuntimeError("injected fault")
        return choose(request, logits)

    monkeypatch.setattr(engine.batcher, "_choose", failing_choice)
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 20, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"                    # the stream still ends as every stream does
    last = json.loads(events[-2])
    assert last["error"]["type"] == "server_error" and "injected fault" in last["error"]["message"]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in openai_client(base).chat.completions.create(model="smollm2", **body):
            pass


def test_a_failing_device_step_is_a_500_and_the_next_request_is_right(server, alone, monkeypatch):
    base, engine = server
    model, text = alone
    session, failed = engine.batcher.session, []
    decode_lines = session.decode_lines

    def fails_once(*args):
        if not failed:
            failed.append(1)
            raise RuntimeError("the device step failed")
        return decode_lines(*args)

    monkeypatch.setattr(session, "decode_lines", fails_once)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 500 and "the device step failed" in response.json()["error"]["message"]
        assert failed and http.get("/health").status_code == 200
        again = http.post("/v1/completions", json=body)
    ids = list(model.tokenizer(body["prompt"])["input_ids"])
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text(ids, 8)


def test_extreme_but_valid_sampling_values_answer(server, alone):
    base, _ = server
    model, text = alone
    greedy = text(list(model.tokenizer("Hello, my name is")["input_ids"]), 8)
    with httpx.Client(base_url=base, timeout=60) as http:
        for options in ({"temperature": 1e-40}, {"temperature": 1e-30, "top_p": 1e-9}, {"top_p": 1e-9},
                        {"temperature": 1e30}, {"temperature": 1e30, "top_k": 1}, {"temperature": 2.5}):
            response = http.post("/v1/completions", json={"prompt": "Hello, my name is", "max_tokens": 8,
                                                          "seed": 3, **options})
            assert response.status_code == 200, (options, response.text)
            answer = response.json()["choices"][0]
            assert answer["finish_reason"] == "length", options
            if options.get("temperature", 1) < 1e-5 or "top_p" in options or "top_k" in options:
                assert answer["text"] == greedy, options
        for raw in (b'{"prompt": "Hi", "temperature": Infinity}', b'{"prompt": "Hi", "temperature": NaN}'):
            response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


class _Crash(BaseException):
    """What stops an engine thread in the test below (no Exception: nothing catches it)."""


def test_if_the_engine_thread_dies_health_fails_and_clients_get_errors_not_a_hang(server):
    from serving.engine import Engine
    from serving.openai_api import create_app

    _, running = server
    engine = Engine(running.model, "smollm2").start()

    def crash():
        raise _Crash("the engine broke")

    engine.batcher.step = crash                    # before any program runs: the model is untouched

    async def ask():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://pyhlo", timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            body = {"prompt": "Hello", "max_tokens": 4}
            waiting = await asyncio.wait_for(http.post("/v1/completions", json=body), timeout=30)
            health = await http.get("/health")
            later = await http.post("/v1/completions", json=body)
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            return waiting, health, later, streamed

    waiting, health, later, streamed = asyncio.run(ask())
    assert waiting.status_code in (500, 503) and "the engine broke" in waiting.json()["error"]["message"]
    for response in (health, later, streamed):
        assert response.status_code == 503, response.text
        assert "the engine broke" in response.json()["error"]["message"]
    assert not engine.alive and "_Crash" in engine.failure


def test_a_client_leaving_a_non_streamed_request_cancels_it_within_a_step(server):
    base, engine = server
    body = {"prompt": "Count from one to a hundred: one, two,", "max_tokens": 200, "temperature": 0}

    def running():
        return [r for r in engine.batcher.lines if r is not None and len(r.tokens) >= 3]

    async def leave():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while not running():
                assert time.monotonic() < deadline, "the request did not start in 60 s"
                await asyncio.sleep(0.005)
            request = running()[0]
            task.cancel()                                  # the client closes its connection
            at_leaving = len(request.tokens)
            with pytest.raises(asyncio.CancelledError):
                await task
            return request, at_leaving

    request, at_leaving = asyncio.run(leave())
    wait_for(lambda: request.done, "the request ended after its client left", seconds=30)
    assert request.finish_reason == "cancelled"
    # Within a step or so of leaving (a step here is tens of milliseconds; the server checks every 20 ms).
    assert len(request.tokens) <= at_leaving + 3, (at_leaving, len(request.tokens))
