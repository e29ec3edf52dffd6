"""Continuous batching: requests come and go while the batch keeps running.

    batcher = ContinuousBatcher(model)            # a model built with ContinuousBatchingConfig
    request = batcher.submit([1, 2, 3], max_new_tokens=32, on_token=print)
    while batcher.busy:
        batcher.step()

Each batch line holds one request at a time. A step runs every active line once: a line with
prompt tokens still to write takes the next chunk of them (a context bucket wide); then the
lines that are generating take their newest token in one decode step (in the programs for
that many rows when few lines are active). The chunks of one width run together in one
program over those lines only (Session.prefill_lines) where the session compiled such
programs for that width (its narrowest buckets: short prompts arriving together, or the rest
of prompts whose prefix a line kept); a wider chunk, or one whose every position's logits are
asked for (prompt logprobs), runs in a program for its line alone, costing its own tokens
only. Grouping by width keeps a short prompt from being padded to a long one's chunk. Where
the caches are spread over replicas (no programs for some lines) the chunks and the newest
tokens share one program over every line instead. A request that ends (an end-of-sequence
token, its token budget, or the end of the cache) frees its line for the next waiting request.

Prefix caching: a free line keeps the keys and values of the tokens its last request wrote.
A new request goes to the free line whose kept tokens share the longest prefix with its
prompt (the least recently used free line when none does, so the others' prefixes live
longest), and only the rest of its prompt is computed: a shared system prompt or a chat's
earlier turns are not prefilled again. Where a busy line's written prompt shares at least
COPY_PREFIX_AT_LEAST more tokens than that (a burst of chats with one template, landing on
lines that never held it), the free line is first made a copy of that line (Session.copy_line)
and the shared tokens are not computed either. Tokens are chosen on the host: greedy, or HF
transformers' temperature / top-k / top-p warpers and a seeded torch generator per request. A
request's constraint (structured output, serving/structured.py) first sets the logits of the
tokens its grammar refuses to -inf.

Faults: a request's failure ends that request alone, with finish_reason "error" and its
`error`; see ContinuousBatcher.step for where that boundary lies.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any, Callable

import numpy as np

from decoders.programs import buckets as bucketing
from decoders.session import choice
from serving import logprobs

log = logging.getLogger("pyhlo")

# Shared prompt tokens from which a busy line's cache is copied into a new request's line rather
# than computed again: a copy of a line's first slots (Session.copy_line) costs far less than a
# 16-token chunk (SmolLM2-135M: 1.3-2.5 ms for 28 slots against 20-30 ms).
COPY_PREFIX_AT_LEAST = 16


@dataclasses.dataclass
class Request:
    """One sequence: its prompt, how to choose its tokens, and what it has produced."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0                 # 0: no top-k filter
    top_p: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    # Applied before the choice, greedy or sampled (choice.penalized): 1.0 / 0.0 / None are off.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None    # record each token's logprob and this many top ones (None: none)
    prompt_logprobs: int | None = None    # the same for the prompt's tokens (its every token computed)
    eos_token_ids: tuple[int, ...] = ()
    # Another request for the same prompt (n choices): this one waits for it to compute the
    # prompt, then starts from a copy of its line's cache.
    shares_prompt_of: Request | None = dataclasses.field(default=None, repr=False)
    on_token: Callable[[Request, int], None] | None = None   # called with each new token
    on_finish: Callable[[Request], None] | None = None
    # The tokens it may take (serving.structured.Constraint: masked() and accept()), or None.
    constraint: Any = None
    id: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)     # generated so far
    finish_reason: str | None = None             # "stop" | "length" | "cancelled" | "error"
    error: str | None = None                     # what went wrong, where finish_reason is "error"
    line: int | None = None
    written: int = 0               # prompt tokens already in the cache
    reused: int = 0                # of those, taken from the line's kept prefix (not computed)
    token_logprobs: list[logprobs.TokenLogprobs] = dataclasses.field(default_factory=list)  # per token
    # Per prompt token where prompt_logprobs is set: the first has none (no context).
    prompt_token_logprobs: list[logprobs.TokenLogprobs | None] = dataclasses.field(default_factory=list)
    _generator: Any = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        """Tokens in its sequence so far (prompt and generated)."""
        return len(self.prompt) + len(self.tokens)


class ContinuousBatcher:
    """The scheduler of a continuous-batching model: which request runs in which batch line,
    and what each line runs at each step.

    It owns the queue of waiting requests, the request in each line, and each free line's
    kept prefix (the tokens its cache still holds, for prefix reuse); it chooses each
    request's tokens on the host and ends requests (end of sequence, budget, end of cache,
    cancelled). The model's Session owns the device state: the batcher only calls its
    continuous-batching entry points (prefill_lines, step_every_line, decode_lines). Not
    thread-safe: one thread steps it (serving.engine.Engine); request() may be called from
    any thread.
    """

    def __init__(self, model: Any):
        if not getattr(model, "continuous_batching", False):
            raise ValueError("ContinuousBatcher needs a model built with NeuronConfig(continuous_batching="
                             "ContinuousBatchingConfig(batch_size_for_shared_caches=N))")
        self.model = model
        self.session = model.session
        self.waiting: collections.deque[Request] = collections.deque()
        self.lines: list[Request | None] = [None] * self.session.batch_size
        # Per line: the tokens whose keys and values its cache holds from slot 0 (while it is
        # free), and the step it was last used at.
        self.kept: list[list[int]] = [[] for _ in self.lines]
        self.last_used: list[int] = [0] * len(self.lines)
        self._ids = itertools.count(1)
        # What the runtime computed, for tests and metrics.
        self.steps = 0
        self.prompt_tokens_written = 0        # computed (not reused) prompt tokens
        self.prompt_tokens_reused = 0

    # -- requests ----------------------------------------------------------------------
    def submit(self, prompt: list[int], max_new_tokens: int, **options: Any) -> Request:
        """Queue a request; its tokens arrive through on_token as steps run."""
        request = self.request(prompt, max_new_tokens, **options)
        self.add(request)
        return request

    def request(self, prompt: list[int], max_new_tokens: int, **options: Any) -> Request:
        """A checked request, not yet queued (add() queues it): safe from any thread."""
        prompt = [int(t) for t in prompt]
        n_positions = self.session.n_positions
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if len(prompt) >= n_positions:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model holds {n_positions} positions "
                             f"(n_positions), so at most {n_positions - 1}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.model.decoder.head.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in 0..{vocab - 1}")
        if any(not 0 <= int(t) < vocab for t in options.get("logit_bias") or {}):
            raise ValueError(f"logit_bias token ids must lie in 0..{vocab - 1}")
        if options.get("prompt_logprobs") is not None and not self.session.row_prefill:
            raise ValueError("a prompt's logprobs need the one-line prefill programs (continuous batching "
                             "over more than one line, caches not spread over replicas)")
        request = Request(prompt, max_new_tokens, id=next(self._ids), **options)
        if request.do_sample:
            request._generator = choice.seeded_generator(request.seed)
        return request

    def add(self, request: Request) -> None:
        """Queue a request made by request()."""
        if not request.done:
            self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Stop a request (a client went away); its line is freed at once."""
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "cancelled")

    def fail(self, request: Request, error: str) -> None:
        """End one request with finish_reason "error"; error says what went wrong."""
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        request.error = error
        self._finish(request, "error")

    def fail_all(self, error: str = "the server could not run this request") -> None:
        """End every request, queued or running, with finish_reason "error" (the engine cannot go on)."""
        for request in [*self.waiting, *(r for r in self.lines if r is not None)]:
            self.fail(request, error)
        self.waiting.clear()

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.lines)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.lines)

    # -- one step ------------------------------------------------------------------------
    def step(self) -> None:
        """Admit waiting requests into free lines, then run every active line once.

        A failure ends the requests it belongs to, with finish_reason "error", and no other:
        choosing a request's token, its callbacks and its prompt's logprobs fail that request
        only. A program fails every request in it (a prompt chunk alone, the chunks of one
        width prefilled together, the decode step, or the one program over every line): their
        logits come from one run, so none of them has a token it can trust, and no request is
        kept waiting on a program that may fail again. Requests still waiting are not touched
        and run in later steps. A failed program may have written (or, its buffers donated,
        lost) any line's cache, so every line's kept prefix is dropped: later prompts are
        computed in full.
        """
        self._admit()
        active = [r for r in self.lines if r is not None]
        if not active:
            return
        if self.session.row_prefill:
            # The prompts' next chunks in programs for their lines only (the cost of their own
            # tokens), then one decode step for the lines that are generating.
            chunked = [r for r in active if len(r.prompt) - r.written > 1]
            for group in self._prefill_groups(chunked):
                self._prefill(group)
            active = [r for r in active if r not in chunked]
        if active:
            self._run_lines(active)
        self.steps += 1

    def _chunk_width(self, r: Request) -> int:
        """The context bucket that r's next prompt chunk runs in."""
        buckets = self.session.context_buckets
        return bucketing.pick(buckets, min(len(r.prompt) - r.written, buckets[-1]))

    def _prefill_groups(self, chunked: list[Request]) -> list[list[Request]]:
        """The requests whose next chunks run in one program: those of one width where the
        session prefills that width for several lines; each of the others alone (a prompt
        whose logprobs are asked for too: every position's logits are computed for it)."""
        together = self.session.batched_prefill_buckets()
        groups: dict[int, list[Request]] = {}
        alone = []
        for r in chunked:
            width = self._chunk_width(r)
            if width in together and r.prompt_logprobs is None:
                groups.setdefault(width, []).append(r)
            else:
                alone.append([r])
        return [*groups.values(), *alone]

    def _prefill(self, group: list[Request]) -> None:
        """The next prompt chunk of each request in `group` (chunks of one width) in one program."""
        session = self.session
        width = self._chunk_width(group[0])
        parts = [r.prompt[r.written:r.written + width] for r in group]
        tokens = np.zeros((len(group), width), np.int32)
        for i, part in enumerate(parts):
            tokens[i, :len(part)] = part
        # Every position's logits only where the prompt's logprobs are asked for (a group of one).
        every = group[0].prompt_logprobs is not None
        try:
            logits = session.prefill_lines(tokens, [r.line for r in group], [r.written for r in group],
                                           [len(part) - 1 for part in parts], every_position=every)
        except Exception as error:
            self._program_failed(group, error)
            return
        for i, (r, part) in enumerate(zip(group, parts)):
            if every:
                try:
                    self._prompt_logprobs(r, logits[i, :len(part)])
                except Exception as error:            # this request's own part: it alone fails
                    self.fail(r, f"the prompt's logprobs failed: {type(error).__name__}: {error}")
                    continue
            self._wrote(r, len(part))
            if r.written == len(r.prompt):
                self._give(r, logits[i, len(part) - 1] if every else logits[i])

    def _run_lines(self, active: list[Request]) -> None:
        """One program over every line: a chunk of each pending prompt, the newest token of
        each generating line (lines not in `active` have no part); or, when every active
        line takes one token and there are few of them, the program for that many rows."""
        session = self.session
        prefilling = [r for r in active if r.written < len(r.prompt)]
        if len(active) <= max(session.decode_rows(), default=0) and \
                all(len(r.prompt) - r.written <= 1 for r in prefilling):
            return self._run_rows(active)
        largest = session.context_buckets[-1]
        width = 1
        if prefilling:
            longest = max(len(r.prompt) - r.written for r in prefilling)
            width = 1 if longest == 1 else bucketing.pick(session.context_buckets, min(longest, largest))
        b = session.batch_size
        tokens = np.zeros((b, width), np.int32)
        slots = np.full(b, session.n_positions, np.int32)
        last_index = np.zeros(b, np.int32)
        choosing = []                       # requests whose next token this step gives
        parts = {}                          # request id -> prompt tokens this step writes
        for r in active:
            if r.written < len(r.prompt):
                part = r.prompt[r.written:r.written + width]
                tokens[r.line, :len(part)] = part
                slots[r.line] = r.written
                last_index[r.line] = len(part) - 1
                parts[r.id] = len(part)
                if r.written + len(part) == len(r.prompt):
                    choosing.append(r)
            else:
                tokens[r.line, 0] = r.tokens[-1]
                slots[r.line] = r.length - 1
                choosing.append(r)
        try:
            logits = session.step_every_line(tokens, slots, last_index)
            rows = session.host_logits(logits) if choosing else None
        except Exception as error:
            self._program_failed(active, error)
            return
        # Only now are these tokens in the cache.
        for r in active:
            self._wrote(r, parts.get(r.id, 0))
        for r in choosing:
            self._give(r, rows[r.line])

    def _run_rows(self, active: list[Request]) -> None:
        """One token for each active line, in the programs for that many rows."""
        session = self.session
        tokens = np.zeros(len(active), np.int32)
        slots = np.zeros(len(active), np.int32)
        prompting = [r.written < len(r.prompt) for r in active]     # the prompt's last token
        for i, r in enumerate(active):
            if prompting[i]:
                tokens[i], slots[i] = r.prompt[r.written], r.written
            else:
                tokens[i], slots[i] = r.tokens[-1], r.length - 1
        lines = np.array([r.line for r in active], np.int32)
        try:
            logits = session.host_logits(session.decode_lines(tokens, lines, slots))
        except Exception as error:
            self._program_failed(active, error)
            return
        for r, prompted in zip(active, prompting):
            self._wrote(r, int(prompted))
        for i, r in enumerate(active):
            self._give(r, logits[i])

    def _wrote(self, r: Request, n: int) -> None:
        """n more of r's prompt tokens are in its line's cache (a program that wrote them succeeded)."""
        r.written += n
        self.prompt_tokens_written += n

    def _admit(self) -> None:
        """Waiting requests, first come first served, each into the free line that holds the
        longest prefix of its prompt (the least recently used one when none does). A request
        sharing another's prompt waits (others pass it) until that one has written all of
        the prompt but its last token, then starts from a copy of its line."""
        passed: list[Request] = []
        while self.waiting and None in self.lines:
            request = self.waiting.popleft()
            leader = request.shares_prompt_of
            if leader is not None and not leader.done and leader.line is not None \
                    and leader.written < len(request.prompt) - 1:
                passed.append(request)
                continue
            free = [i for i, held in enumerate(self.lines) if held is None]
            if leader is not None and not leader.done and leader.line is not None \
                    and self.lines[leader.line] is leader and len(request.prompt) > 1:
                self._admit_sharing(request, leader, free)
                continue
            # The prompt's last token always runs: its logits give the first new token.
            # A prompt whose logprobs are asked for is computed in full.
            shared = {i: 0 if request.prompt_logprobs is not None else
                      _common_prefix(self.kept[i], request.prompt[:-1]) for i in free}
            line = max(free, key=lambda i: (shared[i], -self.last_used[i]))
            reused = shared[line]
            self.lines[line] = request
            self.kept[line] = []
            request.line = line
            source, held = self._busy_line_sharing(request)
            if held >= reused + COPY_PREFIX_AT_LEAST:
                try:
                    self.session.copy_line(source, line, slots=held)
                except Exception as error:
                    self._program_failed([request], error)
                    continue
                reused = held
            request.written = request.reused = reused
            self.prompt_tokens_reused += reused
        self.waiting.extendleft(reversed(passed))

    def _busy_line_sharing(self, request: Request) -> tuple[int, int]:
        """The busy line whose written prompt tokens share the longest prefix with request's
        prompt (all but its last token), and how many they share; (-1, 0) where none can be
        copied (no whole lines per device, a prompt computed in full for its logprobs)."""
        if not self.session.row_prefill or request.prompt_logprobs is not None:
            return -1, 0
        best = (-1, 0)
        for line, held in enumerate(self.lines):
            if held is not None and held is not request:
                shared = _common_prefix(held.prompt[:held.written], request.prompt[:-1])
                best = max(best, (line, shared), key=lambda pair: pair[1])
        return best

    def _admit_sharing(self, request: Request, leader: Request, free: list[int]) -> None:
        """request into a free line holding a copy of its leader's, its prompt but the last
        token written (the last runs: its logits give the request's own first token)."""
        line = min(free, key=lambda i: self.last_used[i])
        self.lines[line] = request
        self.kept[line] = []
        request.line = line
        try:
            self.session.copy_line(leader.line, line, slots=len(request.prompt) - 1)
        except Exception as error:
            self._program_failed([request], error)
            return
        request.written = request.reused = len(request.prompt) - 1
        self.prompt_tokens_reused += request.written
        if request.prompt_logprobs is not None:
            request.prompt_token_logprobs = list(leader.prompt_token_logprobs)

    def _prompt_logprobs(self, request: Request, rows: np.ndarray) -> None:
        """The logprobs of the prompt tokens that a chunk's logits rows [n, vocab] predict
        (the chunk's last row, past the prompt, predicts the first new token: not one of them)."""
        start = request.written
        if start == 0:
            request.prompt_token_logprobs.append(None)
        following = request.prompt[start + 1:start + 1 + len(rows)]
        request.prompt_token_logprobs += logprobs.of_prompt(rows[:len(following) + 1],
                                                           request.prompt[start:start + len(following) + 1],
                                                           request.prompt_logprobs)[1:]

    def _program_failed(self, requests: list[Request], error: Exception) -> None:
        """A program failed: its requests end with an error, and no line's kept prefix is trusted."""
        log.error("a program over %d line(s) failed: %s: %s", len(requests), type(error).__name__, error,
                  exc_info=error)
        for request in requests:
            self.fail(request, f"the step computing this request failed: {type(error).__name__}: {error}")
        self.kept = [[] for _ in self.lines]

    def _give(self, request: Request, logits: np.ndarray) -> None:
        """Choose the request's next token and hand it over; a failure there ends this request alone."""
        try:
            token = self._choose(request, logits)
            if request.logprobs is not None:
                request.token_logprobs.append(logprobs.of_token(logits, token, request.logprobs))
            self._accept(request, token)
        except Exception as error:
            log.error("request %d failed: %s: %s", request.id, type(error).__name__, error, exc_info=error)
            self.fail(request, f"choosing this request's token failed: {type(error).__name__}: {error}")

    def _choose(self, request: Request, logits: np.ndarray) -> int:
        if request.repetition_penalty != 1.0 or request.presence_penalty or request.frequency_penalty \
                or request.logit_bias:
            logits = choice.penalized(logits, request.prompt, request.tokens, request.repetition_penalty,
                                      request.presence_penalty, request.frequency_penalty, request.logit_bias)
        if request.constraint is not None:            # structured output: the grammar's tokens only
            if not request.do_sample:
                return request.constraint.greedy(logits)
            logits = request.constraint.masked(logits)
        if not request.do_sample:
            return int(np.argmax(logits))
        return choice.draw(choice.probabilities(logits, request.temperature, request.top_k, request.top_p),
                           request._generator)

    def _accept(self, request: Request, token: int) -> None:
        if request.constraint is not None:
            request.constraint.accept(token)
        request.tokens.append(token)
        if request.on_token is not None:
            request.on_token(request, token)
        if token in request.eos_token_ids or (request.constraint is not None and request.constraint.finished):
            self._finish(request, "stop")
        elif len(request.tokens) >= request.max_new_tokens or request.length >= self.session.n_positions:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request.line is not None and self.lines[request.line] is request:
            self.lines[request.line] = None
            # What the cache holds: the prompt as far as it was written, then every generated
            # token but the last (which was never fed back). Nothing is trusted after an error.
            fed = len(request.prompt) + max(len(request.tokens) - 1, 0) \
                if request.written == len(request.prompt) else request.written
            self.kept[request.line] = (request.prompt + request.tokens)[:fed] if reason != "error" else []
            self.last_used[request.line] = self.steps
        if request.on_finish is not None:
            try:
                request.on_finish(request)
            except Exception:             # the request is over either way; the others go on
                log.exception("request %d: its on_finish callback failed", request.id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
