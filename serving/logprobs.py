"""Log-probabilities of tokens, as the OpenAI API returns them.

A token's logprob is of the distribution the model gave (the log-softmax of its raw logits,
before temperature, penalties, logit_bias, top-k or top-p: vLLM's default, "raw_logprobs"),
so a greedy and a sampled request agree on it. The batcher records one TokenLogprobs per
generated token (of_token); the API shapes them:

    chat         choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [...]}]}
    completions  choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
                 (OpenAI's legacy shape; with echo the prompt's tokens first, the first one's
                 logprob null, as it has no context)

Tokens and text: each token's text is its own decoding; which tokens a text holds (a text cut
at a stop string, or a streamed piece) is found from the decoded length of the tokens before
each one (Offsets).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class TokenLogprobs:
    """One token's logprob and the `top` most likely tokens' (id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """f32 log-softmax over the last axis (torch's, as HF transformers computes it)."""
    import torch

    return torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits, np.float32)), dim=-1).numpy()


def of_token(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """The logprob of `token` under raw logits [vocab], and the `top` best tokens'."""
    logprobs = log_softmax(np.asarray(logits).reshape(-1))
    return TokenLogprobs(int(token), float(logprobs[token]), _top(logprobs, top))


def of_prompt(logits: np.ndarray, prompt: list[int], top: int) -> list[TokenLogprobs | None]:
    """Each prompt token's logprob given the tokens before it, from the logits [len(prompt),
    vocab] at every prompt position (row i predicts token i + 1); the first token has none."""
    logprobs = log_softmax(logits)
    out: list[TokenLogprobs | None] = [None]
    for i, token in enumerate(prompt[1:]):
        out.append(TokenLogprobs(int(token), float(logprobs[i, token]), _top(logprobs[i], top)))
    return out


def _top(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    best = np.argpartition(-logprobs, min(k, logprobs.shape[0] - 1))[:k]
    best = best[np.argsort(-logprobs[best], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in best]


class Offsets:
    """Where each of a growing list of tokens begins in their decoded text."""

    def __init__(self, tokenizer: Any, tokens: list[int]):
        self.tokenizer, self.tokens = tokenizer, tokens
        self._starts: list[int] = []

    def start(self, i: int) -> int:
        """The length of the text of tokens[:i]."""
        while len(self._starts) <= i:
            k = len(self._starts)
            self._starts.append(len(self.tokenizer.decode(self.tokens[:k], skip_special_tokens=True)))
        return self._starts[i]

    def within(self, length: int, upto: int) -> int:
        """How many of the first `upto` tokens begin inside a text's first `length` characters
        (a token straddling the end counts: its text is partly there)."""
        n = 0
        while n < upto and self.start(n) < length:
            n += 1
        return n


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_content(tokenizer: Any, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs.content for these tokens."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprobs | None], tokens: list[int],
                        offsets: list[int]) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs for these tokens (an entry None: a token with no
    logprob, the first of an echoed prompt), each beginning at offsets[i] of the text."""
    top: list[dict[str, float] | None] = []
    for e in entries:
        if e is None:
            top.append(None)
            continue
        # The chosen token is always among them (so up to logprobs + 1), as OpenAI and vLLM list it.
        shown = {token_text(tokenizer, t): lp for t, lp in e.top}
        shown.setdefault(token_text(tokenizer, e.token), e.logprob)
        top.append(shown)
    return {"tokens": [token_text(tokenizer, t) for t in tokens],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": list(offsets)}


class ChoiceLogprobs:
    """A choice's logprobs in the API's shape, handed out as its text grows: each call gives
    the tokens not given before whose text begins in the text's first `length` characters (a
    stream's pieces; a text cut at a stop string leaves out the tokens after it; an end of
    sequence, with no text, is never given). Completions' text_offset counts from text_start
    (the echoed prompt's length)."""

    def __init__(self, tokenizer: Any, request: Any, chat: bool, text_start: int = 0):
        self.tokenizer, self.request, self.chat, self.text_start = tokenizer, request, chat, text_start
        self.offsets = Offsets(tokenizer, request.tokens)
        self.given = 0

    def upto(self, length: int) -> dict[str, Any]:
        # The engine thread records a token's logprobs, then appends the token: both are there
        # for the first min(...) tokens.
        available = min(len(self.request.token_logprobs), len(self.request.tokens))
        end = max(self.offsets.within(length, available), self.given)
        entries = self.request.token_logprobs[self.given:end]
        starts = [self.text_start + self.offsets.start(i) for i in range(self.given, end)]
        self.given = end
        if self.chat:
            return {"content": chat_content(self.tokenizer, entries)}
        return completion_logprobs(self.tokenizer, entries, [e.token for e in entries], starts)


def joined(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    """Two completions logprobs one after the other (an echoed prompt's, then the answer's)."""
    return {key: first[key] + then[key] for key in first}
