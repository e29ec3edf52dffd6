"""Tool calling in OpenAI's shape over a model's own chat template.

The tools go to the chat template (tokenizer.apply_chat_template(..., tools=...)), which tells
the model how to call them; what the model writes is read back into OpenAI's `tool_calls`. Two
formats, told apart by the template:

    hermes    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen 2/2.5/3)
    llama3    {"name": "f", "parameters": {...}}                               (Llama 3.1 / 3.2)

tool_choice "auto" lets the model choose; "required" and a named function constrain its output
to one call in its format, the arguments valid against the function's parameters schema
(serving/structured.py), so the call always parses; "none" renders no tools and reads no call.
Assistant messages with tool_calls and `tool` messages go back through the template, the
arguments as the objects templates expect.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from serving.structured import Grammars, lark_grammar, lark_json

MARKERS = {"hermes": ("<tool_call>", "</tool_call>")}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; the message names the fix."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def call_format(chat_template: str | None) -> str:
    """"hermes" or "llama3": how the model behind `chat_template` writes a call."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template and "parameters" in template:
        return "llama3"
    raise ToolError("this model's chat template renders no tool calls pyhlo can read (neither Hermes/Qwen's "
                    "<tool_call> nor Llama 3's JSON calls): send no tools", "tools")


def check(tools: list[dict], tool_choice: Any) -> str | None:
    """The name of the function tool_choice forces, or None; ToolError for a bad request."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"parameters\": {...}}}}", f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        names.append(function["name"])
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        if not tools:
            raise ToolError("tool_choice \"required\" needs tools", "tool_choice")
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools ({names})",
                        "tool_choice")
    return name


def grammar(tools: list[dict], forced: str | None, fmt: str, grammars: Grammars) -> str:
    """The grammar of one call in format `fmt` to the function `forced` (any of `tools` when
    None), its arguments valid against that function's parameters."""
    calls = []
    for tool in tools:
        function = tool["function"]
        if forced is not None and function["name"] != forced:
            continue
        key = "parameters" if fmt == "llama3" else "arguments"
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                      "properties": {"name": {"const": function["name"]},
                                     key: function.get("parameters") or {"type": "object"}}})
    call = lark_json(calls[0] if len(calls) == 1 else {"anyOf": calls})
    if fmt == "hermes":
        opening, closing = (grammars.token_text(m) for m in MARKERS["hermes"])
        return lark_grammar(f'start: {opening} "\\n" call "\\n" {closing}\ncall: {call}\n')
    return lark_grammar(f"start: call\ncall: {call}\n")


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages as chat templates take them: an assistant call's arguments as an object
    (OpenAI sends a JSON string). ToolError for a message without content that needs one."""
    shaped = []
    for i, message in enumerate(messages):
        message = dict(message)
        calling = message.get("role") == "assistant" and message.get("tool_calls")
        if message.get("content") is None and not calling:
            raise ToolError(f"messages[{i}] has no content (only an assistant message with tool_calls may "
                            "have none)", f"messages.{i}.content")
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        raise ToolError(f"a tool call's arguments are not JSON: {arguments[:80]!r}",
                                        "messages") from None
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        shaped.append(message)
    return shaped


def parse(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from a model's answer: tool_calls in OpenAI's shape (arguments a
    JSON string), content the text around them (None when there is none). Text that holds no
    well-formed call is all content."""
    found = []
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        for body in _HERMES_CALL.findall(text[start:]):
            found.append(_json(body))
        content = text[:start] if text[:start].strip() else None
    else:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        found = [_json(part) for part in _split_calls(body)]
        content = None
    calls = []
    for value in found:
        arguments = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"], "arguments": json.dumps(arguments)}})
    return content, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _split_calls(body: str) -> list[str]:
    """Llama 3's calls, one JSON object each, separated by ";" or whitespace."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return [body]                      # not calls: parse() keeps it as content
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return parts


class StreamSplitter:
    """Splits a streamed answer into content to send now and text held back as a possible call.

    feed(piece) gives the content that can go out at once: hermes holds back from "<tool_call>"
    on (and any end that may be its start); llama3 holds back an answer whose first visible
    character opens a JSON object. finish() gives (rest of content, tool_calls) at the end."""

    def __init__(self, fmt: str):
        self.fmt, self.text, self.sent = fmt, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.fmt == "hermes":
            start = self.text.find("<tool_call>")
            if start < 0:
                start = len(self.text) - _partial_marker(self.text, "<tool_call>")
        else:
            head = self.text.lstrip()
            maybe_call = not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head)
            start = 0 if maybe_call else len(self.text)
        out = self.text[self.sent:max(start, self.sent)]
        self.sent = max(start, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = parse(self.text, self.fmt)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        start = self.text.find("<tool_call>") if self.fmt == "hermes" else 0
        rest = self.text[self.sent:start] if content else ""
        return rest, calls


def _partial_marker(text: str, marker: str) -> int:
    """How many of text's last characters are the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
