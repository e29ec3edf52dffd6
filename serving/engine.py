"""The model behind the server: one thread runs the continuous batcher; asyncio handlers
submit requests and read their text from queues.

Handlers never wait for a step: they hand requests and cancellations to the engine thread
through an inbox, which it empties before each step.

Each request's tokens go through HF transformers' TextStreamer (its word-boundary and
UTF-8-safe decoding) into an asyncio queue of text pieces, closed by None. Prometheus
metrics count requests, tokens, queue length, busy lines and time to first token. Each
finished request gives one line on the `pyhlo.requests` logger (show_request_log()).

A request that fails ends alone with finish_reason "error" (the batcher draws that line, see
ContinuousBatcher.step). Should the thread itself stop on an error, every request it held or
was sent ends with an error, `alive` turns false (the API's /health answers 503) and submit()
raises EngineStopped.

Its gauges (waiting and running requests, busy lines, KV-cache use) are read when /metrics is
scraped, so they are true at every moment, idle included. The running and waiting requests
and the KV-cache use are the three reads of the Kubernetes Gateway API inference extension's
model-server protocol (vLLM's num_requests_running, num_requests_waiting, kv_cache_usage_perc).
At most max_waiting requests wait for a line (QueueFull past that); stop_accepting() refuses
new requests while the running ones finish (a graceful shutdown, serving/shutdown.py).
"""
from __future__ import annotations

import asyncio
import logging
import queue as queues
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from transformers import TextStreamer

from serving.scheduler import ContinuousBatcher, Request
from serving.structured import Grammars

log = logging.getLogger("pyhlo")
request_log = logging.getLogger("pyhlo.requests")


def show_request_log(shown: bool = True) -> None:
    """Show the line per finished request at the default log level (WARNING, where `-v` is
    not given), or hide it even under `-v`: its logger's own level, INFO or WARNING."""
    request_log.setLevel(logging.INFO if shown else logging.WARNING)


class EngineStopped(RuntimeError):
    """The engine thread is not running, or takes no new request: no request can be served."""


class QueueFull(RuntimeError):
    """max_waiting requests already wait for a batch line: try again later."""


@dataclass
class Sampling:
    """What a request asks of the token choice and of its end."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None            # each token's logprob and this many top ones (None: none)
    prompt_logprobs: int | None = None     # the same for the prompt's tokens
    constraint: Any = None            # serving.structured.Constraint: the tokens it may take, or None


class _QueueStreamer(TextStreamer):
    """TextStreamer whose finished text pieces go to an asyncio queue (from the engine thread).

    TextStreamer holds the last word back until a space follows it, in case a later token
    changes it: so a reply's first text waited a decode step after its first token. Where the
    tokenizer does not clean up spaces when decoding (clean_up_tokenization_spaces false, as
    for the byte-level BPE and SentencePiece tokenizers of today's models), the decoded text
    only grows as tokens come, save a character whose bytes are not all there yet (decoded
    as U+FFFD): each token's text goes out at once, as vLLM and llama-server send it, all but
    such a character. Otherwise TextStreamer's rule stands."""

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.loop, self.queue = loop, queue
        self.at_once = getattr(tokenizer, "clean_up_tokenization_spaces", True) is False

    def put(self, value: Any) -> None:
        if not self.at_once:
            return super().put(value)
        self.token_cache.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        ready = max(self.print_len, len(text.rstrip("\ufffd")))
        piece = text[self.print_len:ready]
        self.print_len = ready
        if text.endswith("\n"):           # as TextStreamer: a line's tokens are decoded no more
            self.token_cache, self.print_len = [], 0
        self.on_finalized_text(piece)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            _hand_over(self.loop, self.queue, text)


def _hand_over(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: str | None) -> None:
    """Put item on an event loop's queue from the engine thread; nothing when that loop is
    closed (the server exited at once, on a second signal: nobody reads it)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        if not loop.is_closed():
            raise


class Engine:
    """The thread that owns a ContinuousBatcher and steps it while requests are in it.

    It owns the batcher (only its thread touches it), the inbox through which the event loop
    hands it requests and cancellations, and the Prometheus metrics. A step that fails ends
    the requests it held with an error; the thread lives on. An error outside a step stops
    the thread: `failure` says what it was.
    """

    def __init__(self, model: Any, name: str, max_waiting: int | None = None):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (or None: no bound), got {max_waiting}")
        self.model = model
        self.max_waiting = max_waiting
        self.name = name
        self.tokenizer = model.tokenizer
        self.batcher = ContinuousBatcher(model)
        self.eos_token_ids = tuple(model.eos_ids(None))
        # Structured output and tool calls: llguidance's view of the tokenizer, built on first use.
        self.grammars = Grammars(self.tokenizer, model.decoder.head.vocab_size, self.eos_token_ids)
        # (kind, request, reason): "add" | "cancel" (reason: why, for the request log) | "stop"
        self._inbox: queues.SimpleQueue = queues.SimpleQueue()
        self._ended_by: dict[int, str] = {}          # request id -> why it was cancelled (engine thread)
        self._thread = threading.Thread(target=self._run, name="pyhlo-engine", daemon=True)
        self.failure: str | None = None               # why the thread stopped, if an error stopped it
        self.refusal: str | None = None               # why new requests are refused (stop_accepting)
        # Requests submitted and not finished, by id: the event loop adds, the engine thread removes.
        self._open: dict[int, Request] = {}
        self._open_lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.requests = Counter("pyhlo_requests", "Requests by how they ended", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter("pyhlo_prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.cached_tokens = Counter("pyhlo_prompt_tokens_cached",
                                     "Prompt tokens found in a line's cached prefix", registry=self.registry)
        self.generated_tokens = Counter("pyhlo_generated_tokens", "Tokens generated", registry=self.registry)
        # Gauges read at scrape time (set_function): never stale, idle or not.
        self.waiting = Gauge("pyhlo_waiting_requests", "Requests waiting for a batch line",
                             registry=self.registry)
        self.waiting.set_function(self.waiting_requests)
        self.running = Gauge("pyhlo_running_requests", "Requests in a batch line (being computed)",
                             registry=self.registry)
        self.running.set_function(lambda: self.batcher.active)
        self.busy_lines = Gauge("pyhlo_busy_lines", "Batch lines holding a request", registry=self.registry)
        self.busy_lines.set_function(lambda: self.batcher.active)
        self.lines = Gauge("pyhlo_lines", "Batch lines (KV cache lines)", registry=self.registry)
        self.lines.set(model.batch_size)
        # A request holds a whole line's cache (n_positions slots) from its admission to its end.
        self.kv_cache_usage = Gauge("pyhlo_kv_cache_usage_ratio",
                                    "Fraction of the KV cache held by running requests (0 to 1)",
                                    registry=self.registry)
        self.kv_cache_usage.set_function(lambda: self.batcher.active / len(self.batcher.lines))
        self.ttft = Histogram("pyhlo_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                              registry=self.registry)
        self.steps = Counter("pyhlo_steps", "Batch steps run", registry=self.registry)

    @property
    def n_positions(self) -> int:
        return self.model.n_positions

    @property
    def alive(self) -> bool:
        """The thread runs and serves requests."""
        return self._thread.is_alive() and self.failure is None

    def waiting_requests(self) -> int:
        """Requests submitted that no batch line holds yet (queued, or on their way in)."""
        with self._open_lock:
            return sum(1 for r in self._open.values() if r.line is None)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread; requests it still holds end with an error."""
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout=30)

    def stop_accepting(self, reason: str) -> None:
        """Refuse new requests from now on (submit raises EngineStopped(reason)); running and
        waiting ones go on."""
        self.refusal = reason

    def fail_waiting(self, error: str) -> None:
        """End every request no line holds yet with this error (the running ones go on)."""
        self._inbox.put(("fail_waiting", None, error))

    def fail_running(self, error: str) -> None:
        """End every request, running or waiting, with this error."""
        self._inbox.put(("fail_all", None, error))

    # -- requests (from the event loop) ----------------------------------------------------
    def submit(self, prompt: list[int], sampling: Sampling, loop: asyncio.AbstractEventLoop,
               label: str | None = None,
               shares_prompt_of: Request | None = None) -> tuple[Request, asyncio.Queue]:
        """Queue a request; text pieces arrive on the returned queue, then None. label: its
        name in the request log (the API's response id; default request-<n>); shares_prompt_of:
        a request for the same prompt whose computed prompt this one copies. Raises
        EngineStopped when the thread is not running, ValueError for a bad request."""
        if not self.alive:
            raise EngineStopped(self.failure or "the engine is not running")
        if self.refusal is not None:
            raise EngineStopped(self.refusal)
        if self.max_waiting is not None and self.waiting_requests() >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests already wait for a batch line (the server's "
                            f"--max-waiting); try again shortly")
        queue: asyncio.Queue = asyncio.Queue()
        streamer = _QueueStreamer(self.tokenizer, loop, queue)
        arrived = time.perf_counter()

        def on_token(request: Request, token: int) -> None:
            if len(request.tokens) == 1:
                self.ttft.observe(time.perf_counter() - arrived)
                self.cached_tokens.inc(request.reused)
            self.generated_tokens.inc()
            if token not in request.eos_token_ids:
                import torch

                streamer.put(torch.tensor([token]))

        def on_finish(request: Request) -> None:
            with self._open_lock:
                self._open.pop(request.id, None)
            streamer.end()
            self.requests.labels(request.finish_reason).inc()
            request_log.info("%s prompt_tokens=%d cached=%d completion_tokens=%d time=%.2fs finish_reason=%s",
                             label or f"request-{request.id}", len(request.prompt), request.reused,
                             len(request.tokens), time.perf_counter() - arrived,
                             self._ended_by.pop(request.id, request.finish_reason))
            _hand_over(loop, queue, None)

        greedy = sampling.temperature == 0
        options = dict(do_sample=not greedy, temperature=sampling.temperature if not greedy else 1.0,
                       top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
                       repetition_penalty=sampling.repetition_penalty,
                       presence_penalty=sampling.presence_penalty,
                       frequency_penalty=sampling.frequency_penalty, logit_bias=sampling.logit_bias,
                       logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs,
                       eos_token_ids=self.eos_token_ids, on_token=on_token, on_finish=on_finish,
                       shares_prompt_of=shares_prompt_of)
        options["constraint"] = sampling.constraint
        request = self.batcher.request(prompt, sampling.max_tokens, **options)     # a ValueError: bad request
        self.prompt_tokens.inc(len(prompt))
        with self._open_lock:
            self._open[request.id] = request
        self._inbox.put(("add", request, None))
        return request, queue

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End a request (its line is freed); reason says why in the request log (e.g. "stop"
        for a stop string the API found), its metrics count it as cancelled."""
        self._inbox.put(("cancel", request, reason))

    def idle(self) -> bool:
        """No request queued, running, or on its way in: every request submitted has ended.
        (Not "the inbox is empty and the batcher idle": the thread moving a request from
        the one to the other holds it in neither, and a shutdown that read idle then would
        exit under it.)"""
        with self._open_lock:
            return not self._open

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:
            self.failure = f"the engine stopped: {type(error).__name__}: {error}"
            log.exception("the engine thread stopped; failing every request it holds")
            self._fail_everything(self.failure)

    def _fail_everything(self, error: str) -> None:
        """End every request held or on its way in with an error (the thread is stopping)."""
        try:
            self.batcher.fail_all(error)
        except Exception:
            log.exception("ending the running requests failed")
        while True:
            try:
                kind, request, _ = self._inbox.get_nowait()
            except queues.Empty:
                break
            if kind == "add":
                self.batcher.fail(request, error)

    def _loop(self) -> None:
        batcher = self.batcher
        while True:
            # Block for work when idle; otherwise take whatever arrived since the last step.
            while True:
                try:
                    kind, request, reason = self._inbox.get(block=not batcher.busy)
                except queues.Empty:
                    break
                if kind == "stop":
                    self._fail_everything("the server stopped before this request finished")
                    return
                if kind == "add":
                    batcher.add(request)
                elif kind == "fail_waiting":
                    for waiting in list(batcher.waiting):
                        batcher.fail(waiting, reason)
                elif kind == "fail_all":
                    batcher.fail_all(reason)
                else:
                    if not request.done:
                        self._ended_by[request.id] = reason
                    batcher.cancel(request)
            if batcher.busy:
                try:
                    batcher.step()
                except Exception as error:     # not a program's nor a request's fault (those the
                    # batcher ends themselves): the batcher's own state is in doubt, so every
                    # request in it ends with an error; the server lives on.
                    log.exception("a batch step failed; ending its requests")
                    batcher.fail_all(f"a batch step failed: {type(error).__name__}: {error}")
                self.steps.inc()
