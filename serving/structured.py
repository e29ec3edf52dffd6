"""Structured output: the tokens a request may take next, by a grammar, through llguidance.

    grammars = Grammars(tokenizer, vocab_size=49152, eos_token_ids=(2,))
    constraint = grammars.constraint(json_schema_grammar(schema))   # ValueError: a bad schema
    logits = constraint.masked(logits)        # disallowed tokens at -inf, before sampling
    token = constraint.greedy(logits)         # or the allowed token of highest logit
    constraint.accept(token)                  # the chosen token moves the grammar on

llguidance was chosen by measurement (tools/bench/grammar_engines.py, strict JSON schema on
SmolLM2's 49152-token vocabulary): it compiles a schema in 0.6-2 ms where xgrammar takes 6-40 ms
and outlines-core 0.08-1 s; its mask, 15-25 us a token, is xgrammar's (9 us) within a fraction
of a percent of a decode step, so it costs least per request until answers pass ~900 tokens.
It also takes Lark grammars that embed JSON schemas, which tool calls need (a call's markers
around JSON arguments valid against the function's parameters).

The end of sequence is allowed only where the grammar accepts; once the grammar is complete
nothing but the end of sequence is. The mask applies on the host, where the batcher chooses
every token (serving/scheduler.py): the batcher never samples on the device.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

# Fixed separators, no free whitespace: a model cannot spend its budget on spaces, and the
# text is what json.dumps writes.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON text valid against `schema` (an object: a JSON schema)."""
    import llguidance

    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    """A grammar in llguidance's Lark syntax (which embeds JSON schemas as %json {...})."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def lark_json(schema: dict) -> str:
    """A Lark rule body matching JSON valid against `schema`, written as this module writes JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


class Grammars:
    """llguidance's view of one tokenizer (built once: about 1.5 s for a 49152-token
    vocabulary), and the constraints compiled over it. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def constraint(self, grammar: str) -> Constraint:
        """A fresh constraint for one request; ValueError naming the problem for a bad grammar."""
        import llguidance

        tokenizer = self.tokenizer
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise ValueError("; ".join(messages) or "the grammar is not valid")
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return Constraint(matcher, self.vocab_size)

    def token_text(self, text: str) -> str:
        """A Lark literal for `text`: the token itself where the tokenizer has `text` as one
        (special) token, which Lark's string literals never match; the string otherwise."""
        ids = self.hf_tokenizer.convert_tokens_to_ids([text])
        unknown = getattr(self.hf_tokenizer, "unk_token_id", None)
        if ids and ids[0] is not None and ids[0] != unknown and ids[0] < self.vocab_size:
            return f"<[{ids[0]}]>"
        return json.dumps(text)


class Constraint:
    """One request's grammar state: which tokens may come next, moved on by each chosen one."""

    def __init__(self, matcher: Any, vocab_size: int):
        import llguidance.numpy

        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def _fill(self) -> np.ndarray:
        """The grammar's bitmask of the tokens allowed next (bit i of word i // 32: token i)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        return self._bitmask[0]

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows next."""
        return self._unpack(self._fill())

    def _unpack(self, bitmask: np.ndarray) -> np.ndarray:
        return np.unpackbits(bitmask.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def masked(self, logits: np.ndarray, bitmask: np.ndarray | None = None) -> np.ndarray:
        """A copy of logits [vocab] (wider rows are cut to vocab_size) with every token the
        grammar refuses at -inf."""
        allowed = self._unpack(self._fill() if bitmask is None else bitmask)
        if not allowed.any():
            raise RuntimeError("the grammar allows no token here")
        return np.where(allowed, np.asarray(logits[:self.vocab_size], np.float32), np.float32(-np.inf))

    def greedy(self, logits: np.ndarray) -> int:
        """The allowed token of highest logit. The unmasked argmax is tried first: where the
        grammar allows it (most steps of a model that follows the format), no mask over the
        whole vocabulary is built."""
        bitmask = self._fill()
        best = int(np.argmax(logits[:self.vocab_size]))
        if (int(bitmask[best // 32]) >> (best % 32)) & 1:
            return best
        return int(np.argmax(self.masked(logits, bitmask)))

    @property
    def finished(self) -> bool:
        """The grammar has ended (its end of sequence taken): no token may follow."""
        return self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


def response_format_grammar(response_format: dict | None) -> str | None:
    """The grammar OpenAI's response_format asks for (None for plain text); ValueError naming
    the problem for one that is not {"type": "text" | "json_object"} or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", "
                         f"got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema must be {\"name\": ..., \"schema\": {...}, "
                         "\"strict\": true}")
    # Strict or not, the schema is kept to: OpenAI's non-strict mode promises less, never more.
    return json_schema_grammar(spec.get("schema", {"type": "object"}))
