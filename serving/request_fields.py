"""The request bodies of the OpenAI API as pyhlo reads them, as pydantic models.

Every field a model declares is either used, or one of IGNORED: fields OpenAI's clients and
gateways send that change nothing here (accepted, their types checked, then ignored). Any
other field is a 400 naming it, so a misspelt `temprature` or an unsupported `tools` is never
silently dropped. Values are checked strictly (no "0.5" for a number, no 1 for a boolean),
with OpenAI's ranges (vLLM's where it takes more: any finite temperature, top_k, up to 20
logprobs). Fields pyhlo knows but takes only at their "off" value (functions: [],
function_call: "none", modalities: ["text"] ...) say so in their error. response_format, tools
and tool_choice are read here as JSON and checked by serving/structured.py and
serving/tool_calls.py. describe() turns
pydantic's errors into OpenAI's message and param.
"""
from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

# Accepted and ignored: labels and routing hints for OpenAI's own service.
IGNORED = {
    "user": "an end-user id, for OpenAI's abuse monitoring",
    "metadata": "tags for OpenAI's stored completions",
    "store": "whether OpenAI stores the completion",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "a hint for OpenAI's prompt cache (pyhlo's prefix cache needs none)",
    "safety_identifier": "an end-user id, for OpenAI's safety checks",
    "parallel_tool_calls": "a tool_choice that forces a call forces one; with auto, the calls the model "
                           "writes are all read",
}

# OpenAI's fields that pyhlo does not support at all (an unknown field's error says so).
UNSUPPORTED = {"audio", "prediction", "web_search_options", "reasoning_effort", "verbosity",
               "functions", "function_call", "modalities", "suffix", "best_of"}

# Fields taken only at their off value: what the error says that value is.
OFF_ONLY = {"functions": "[] or null (use tools)", "function_call": '"none" or null (use tool_choice)',
            "modalities": '["text"] or null', "suffix": '"" or null', "best_of": "1 or null"}

MAX_LOGPROBS = 20          # vLLM's default limit (OpenAI's: 20 on chat, 5 on completions)
INT64 = dict(ge=-2**63, le=2**63 - 1)

# JSON object keys are strings: a token id is parsed from one.
TokenId = Annotated[int, Strict(False)]

_FORBID = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _FORBID
    include_usage: bool = False            # a last chunk with the usage (and no choices)
    include_obfuscation: bool | None = None          # ignored: OpenAI pads chunks against side channels


class TextPart(BaseModel):
    model_config = _FORBID
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError("request_field", "content parts of type '{kind}' are not supported: "
                                      "pyhlo reads text parts only", {"kind": kind})
        return part


class Message(BaseModel):
    model_config = _FORBID
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, or a list of text parts (joined with newlines, as vLLM joins them); none only
    # for an assistant message that carries tool calls.
    content: str | list[TextPart] | None = None
    name: str | None = None                # passed to the chat template, which may use it
    tool_call_id: str | None = None        # a tool message's answer to this call
    tool_calls: list[dict[str, Any]] | None = Field(default=None, min_length=1)   # an assistant's calls

    @model_validator(mode="after")
    def _content_unless_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("request_field", "a message needs content (only an assistant message "
                                      "with tool_calls may leave it out)", {"field": "content"})
        return self

    def for_template(self) -> dict[str, Any]:
        fields = self.model_dump(exclude_none=True)
        if self.content is not None:
            text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
            fields["content"] = text
        return fields


class Common(BaseModel):
    """What chat and completions both take."""

    model_config = _FORBID

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Any finite temperature >= 0, as vLLM takes it (OpenAI's own API stops at 2); null: 1.
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)              # 0 or -1: off (vLLM's convention)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, **INT64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)   # vLLM's, HF's
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by serving/structured.py
    response_format: dict[str, Any] | None = None

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> Common:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("request_field", "stream_options is only allowed with stream: true",
                                      {"param": "stream_options"})
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[str, Field(max_length=0)] | None = None
    best_of: Literal[1] | None = None

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """The echoed prompt's logprobs: as many top tokens as the answer's."""
        return self.logprobs if self.echo else None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Checked by serving/tool_calls.py (each a function with a name and a parameters schema).
    tools: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    functions: Annotated[list[Any], Field(max_length=0)] | None = None
    function_call: Literal["none"] | None = None
    modalities: list[Literal["text"]] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def calls_tools(self) -> bool:
        """Tools are offered: rendered by the chat template, calls read from the answer."""
        return bool(self.tools) and self.tool_choice != "none"

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise PydanticCustomError("request_field", "tool_choice is only allowed when tools are given",
                                      {"param": "tool_choice"})
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many top tokens each token's logprobs list (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("request_field", "top_logprobs needs logprobs: true",
                                      {"param": "top_logprobs"})
        return self


def _field_path(error: dict[str, Any]) -> list[str | int]:
    """The error's loc without pydantic's labels of union members ('str', 'list[int]',
    'tagged-union[...]'); an unknown field's own name (the last) is kept as the client wrote it."""
    loc = [part for part in error.get("loc", ()) if part != "body"]
    own = loc.pop() if error.get("type") == "extra_forbidden" and loc else None
    kept = [part for part in loc if not isinstance(part, str) or not (
        part in ("str", "int", "float", "bool", "none", "constrained-str") or "[" in part)]
    return kept + ([own] if own is not None else [])


def describe(errors: list[dict[str, Any]], known: set[str] | None = None) -> tuple[str, str | None]:
    """OpenAI's (message, param) for pydantic's errors of a request body: the deepest error
    (in a union, the member that got furthest; an unknown field first); known: the body's field names, for a
    misspelt field's "did you mean"."""
    if not errors:
        return "invalid request", None
    error = max(errors, key=lambda e: (len(_field_path(e)), e.get("type") == "extra_forbidden"))
    path = _field_path(error)
    context = error.get("ctx") or {}
    if context.get("field"):               # a check of one field of the model at `path`
        path = [*path, context["field"]]
    param = context.get("param") or ".".join(str(p) for p in path) or None
    kind, message = error.get("type"), error.get("msg", "invalid value")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "request_field":
        return (message if (error.get("ctx") or {}).get("param") else f"{param}: {message}"), param
    top = path[0] if path else None
    if kind == "extra_forbidden":
        name = path[-1] if path else "?"
        if len(path) == 1 and name in UNSUPPORTED:
            return f"pyhlo does not support {name!r}; remove it", param
        close = difflib.get_close_matches(str(name), sorted(known or ()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close and len(path) == 1 else ""
        return f"unknown field {param!r}{hint}: pyhlo does not read it; remove it", param
    if len(path) >= 1 and top in OFF_ONLY:
        return f"pyhlo does not support {top!r} (it takes only {OFF_ONLY[top]})", top
    if kind == "missing":
        return f"{param}: this field is required", param
    return f"{param}: {message}" if param else message, param


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages through the chat template."""

    model_config = _FORBID
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None        # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("request_field", "give either prompt or messages", {"param": "prompt"})
        if self.add_generation_prompt and self.continue_final_message:
            raise PydanticCustomError("request_field", "add_generation_prompt and continue_final_message "
                                      "cannot both be true", {"param": "continue_final_message"})
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = _FORBID
    model: str | None = None
    tokens: list[int]


# Each route's body, for the names a misspelt field is compared with.
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
