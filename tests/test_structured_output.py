"""Structured output and tool calls on a tiny random model: its free text is nonsense, yet with
the grammar's mask (llguidance) every answer parses and validates against its schema, through
the batcher and through the official openai client. Every wait here is bounded."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from server_harness import batched_model, openai_client, serving

SHAPE = dict(n_positions=1024, context_length_estimate=[64, 256])

# A Hermes-style chat template (as Qwen's): tools in the system turn, calls as <tool_call> JSON.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool.function | tojson }}"
    "{%- endfor %}\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "likes_tea"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]},
                         "likes_tea": {"type": "boolean"}}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """(hf_model, directory): a tiny random Llama over the byte-level tokenizer, with a Hermes template."""
    from tiny_llama import as_reference
    from tiny_tokenizer import make_byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    hf = as_reference(LlamaForCausalLM(config))
    directory = tmp_path_factory.mktemp("tiny-chat")
    hf.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return hf, directory


@pytest.fixture(scope="module")
def batched(tiny_chat_model):
    return batched_model(tiny_chat_model[1], **SHAPE)


@pytest.fixture(scope="module")
def server(batched):
    from serving.engine import Engine

    with serving(Engine(batched, "tiny").start()) as running:
        yield running.base, running.engine


def person_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def template_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **options)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


# -- the mask where the token is chosen ------------------------------------------------------------
def hf_constrained_greedy(hf, tokenizer, prompt: list[int], schema: dict, limit: int) -> list[int]:
    """The reference: HF's logits each step, every token llguidance refuses at -inf, argmax."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    from serving.structured import JSON_STYLE

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=320, eos_token=[tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                                       defaults=JSON_STYLE))
    bitmask = llguidance.numpy.allocate_token_bitmask(1, 320)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(limit):
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            allowed = np.array([(int(bitmask[0, i // 32]) >> (i % 32)) & 1 for i in range(320)], bool)
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            assert matcher.consume_token(token)
            out.append(token)
            ids.append(token)
            if token == tokenizer.eos_token_id or matcher.is_stopped():     # nothing may follow
                break
    return out


def test_constrained_lines_take_the_grammars_greedy_tokens_beside_free_lines(tiny_chat_model, batched):
    from serving.scheduler import ContinuousBatcher
    from serving.structured import Grammars, json_schema_grammar

    hf, _ = tiny_chat_model
    tokenizer = batched.tokenizer
    grammars = Grammars(tokenizer, 320, (tokenizer.eos_token_id,))
    batcher = ContinuousBatcher(batched)
    prompts = [tokenizer(f"Person number {i}:")["input_ids"] for i in range(6)]
    eos = (tokenizer.eos_token_id,)
    requests = []
    for i, prompt in enumerate(prompts):
        constraint = grammars.constraint(json_schema_grammar(PERSON)) if i % 2 == 0 else None
        requests.append(batcher.submit(prompt, 80, eos_token_ids=eos, constraint=constraint))
    for _ in range(1000):
        if not batcher.busy:
            break
        batcher.step()
    assert not batcher.busy
    for i, (prompt, request) in enumerate(zip(prompts, requests)):
        if i % 2 == 0:
            assert request.finish_reason == "stop"
            assert request.tokens == hf_constrained_greedy(hf, tokenizer, prompt, PERSON, 80)
            text = tokenizer.decode(request.tokens, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), PERSON)
        else:                  # free lines: nonsense, the random model's own greedy tokens
            with torch.no_grad():
                expected = hf.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert request.tokens == expected[:len(request.tokens)]
            assert not parses(tokenizer.decode(request.tokens, skip_special_tokens=True))


# -- response_format through the API --------------------------------------------------------------
def test_json_schema_answers_parse_and_validate_on_chat_and_completions(server):
    api = openai_client(server[0])
    free = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Describe Ann."}],
                                       max_tokens=40, temperature=0)
    assert not parses(free.choices[0].message.content)          # the mask is what makes it JSON
    for seed, temperature in [(None, 0.0), (1, 1.0), (2, 1.5)]:
        for strict in (True, False):
            done = api.chat.completions.create(model="tiny", messages=user("Describe Ann."), max_tokens=120,
                                               temperature=temperature, seed=seed,
                                               response_format=person_format(strict))
            assert done.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)
        text = api.completions.create(model="tiny", prompt="Ann is", max_tokens=120, temperature=temperature,
                                      seed=seed, extra_body={"response_format": person_format()})
        assert text.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text.choices[0].text), PERSON)


def test_a_streamed_json_answer_equals_the_whole_one(server):
    api = openai_client(server[0])
    messages = [{"role": "user", "content": "Describe Bob."}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=0,
                                        response_format=person_format())
    stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=0,
                                         response_format=person_format(), stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_answers_are_objects(server):
    api = openai_client(server[0])
    reasons = []
    for seed in range(4):
        done = api.chat.completions.create(model="tiny", messages=user(f"Item {seed}"),
                                           max_tokens=200, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        text, reason = done.choices[0].message.content, done.choices[0].finish_reason
        reasons.append(reason)
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:                   # cut by max_tokens: OpenAI's "length", the JSON unfinished
            assert reason == "length" and text.startswith("{")
    assert "stop" in reasons, reasons


def test_json_cut_by_max_tokens_is_length_as_openai_reports_it(server):
    api = openai_client(server[0])
    done = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Describe Cy."}],
                                       max_tokens=5, temperature=0, response_format=person_format())
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].message.content.startswith("{") and not parses(done.choices[0].message.content)


@pytest.mark.parametrize("response_format, problem", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
])
def test_a_bad_response_format_is_a_400_naming_it(server, response_format, problem):
    import httpx

    base, _ = server
    body = {"messages": user("hi"), "max_tokens": 4, "response_format": response_format}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "response_format" and problem in error["message"]
    again = httpx.post(base + "/v1/chat/completions", json={**body, "response_format": person_format()},
                       timeout=30)
    assert again.status_code == 200


# -- tool calls -------------------------------------------------------------------------------------
def validate_call(call, tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id and call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_choices_give_valid_calls(server):
    api = openai_client(server[0])
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        for seed in range(3):
            done = api.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                               tool_choice=choice, max_tokens=120, temperature=1.0, seed=seed)
            message = done.choices[0].message
            assert done.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
            validate_call(message.tool_calls[0], [WEATHER, TIME])
            if isinstance(choice, dict):
                assert message.tool_calls[0].function.name == "get_time"


def test_tool_calls_stream_as_deltas_that_add_up_to_the_whole_answer(server):
    api = openai_client(server[0])
    options = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                   tool_choice="required", max_tokens=120, temperature=0)
    whole = api.chat.completions.create(**options).choices[0].message.tool_calls[0]
    chunks = list(api.chat.completions.create(**options, stream=True))
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in calls) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_auto_and_none_let_the_model_answer_in_text(server):
    base, engine = server
    api = openai_client(base)
    messages = [{"role": "user", "content": "Hello"}]
    for choice in ["auto", "none"]:
        done = api.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                           tool_choice=choice, max_tokens=30, temperature=0)
        # The random model writes no <tool_call>: its nonsense is the content.
        assert done.choices[0].message.tool_calls is None and done.choices[0].message.content
    # "none" renders no tools; "auto" does, through the template.
    none = api.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=1, temperature=0)
    auto = api.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=1,
                                       temperature=0)
    assert none.usage.prompt_tokens == len(template_ids(engine.tokenizer, messages))
    assert auto.usage.prompt_tokens == len(template_ids(engine.tokenizer, messages, tools=[WEATHER]))


def test_a_call_and_its_result_go_back_through_the_template(server):
    base, engine = server
    api = openai_client(base)
    first = [{"role": "user", "content": "Weather in Oslo?"}]
    call = api.chat.completions.create(model="tiny", messages=first, tools=[WEATHER], tool_choice="required",
                                       max_tokens=120, temperature=0).choices[0].message.tool_calls[0]
    turn = first + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"}]
    done = api.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER], max_tokens=3,
                                       temperature=0)
    shaped = [first[0], {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"}]
    ids = template_ids(engine.tokenizer, shaped, tools=[WEATHER])
    assert done.usage.prompt_tokens == len(ids)
    rendered = engine.tokenizer.decode(ids)
    assert "<tool_response>\n{\"temp\": 21}" in rendered and call.function.arguments in rendered


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([{"type": "function"}], "auto", "tools[0]"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}], "required",
     "tools"),
])
def test_bad_tools_are_a_400_naming_them(server, tools, tool_choice, param):
    import httpx

    base, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": tools,
            "tool_choice": tool_choice}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_message_without_content_is_a_400_unless_it_carries_tool_calls(server):
    import httpx

    base, _ = server
    answer = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user"}], "max_tokens": 2},
                        timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages.0.content"


# -- reading calls ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure.\n",
     [("f", {"x": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '{"y": "z"}}</tool_call>', None, [("f", {}), ("g", {"y": "z"})]),
    ("hermes", "no call here", "no call here", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3", '{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": [1]}}', None,
     [("f", {}), ("g", {"a": [1]})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("llama3", '{"city": "Oslo"}', '{"city": "Oslo"}', []),
])
def test_calls_are_read_from_each_format_and_streaming_holds_back_only_calls(fmt, text, content, calls):
    from serving.tool_calls import StreamSplitter, parse

    got_content, got_calls = parse(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    splitter = StreamSplitter(fmt)
    streamed = "".join(splitter.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed_calls = splitter.finish()
    assert streamed + rest == (content or "")
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in got_calls]


@pytest.mark.parametrize("fmt, good, bad", [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
     '{"name": "get_wether", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
])
def test_a_forced_calls_grammar_takes_a_valid_call_and_refuses_an_invalid_one(fmt, good, bad):
    from tiny_tokenizer import make_byte_tokenizer

    from serving import tool_calls
    from serving.structured import Grammars

    tokenizer = make_byte_tokenizer()
    grammars = Grammars(tokenizer, 320, (tokenizer.eos_token_id,))

    def takes(text: str) -> bool:
        constraint = grammars.constraint(tool_calls.grammar([WEATHER, TIME], None, fmt, grammars))
        for token in tokenizer(text)["input_ids"]:
            if not constraint.allowed()[token]:
                return False
            constraint.accept(token)
        return bool(constraint.allowed()[tokenizer.eos_token_id]) or constraint.finished

    assert takes(good) and not takes(bad)
    assert tool_calls.parse(good, fmt)[1][0]["function"]["name"] in ("get_time", "get_weather")
