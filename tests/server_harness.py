"""What the server tests share: a model built for continuous batching, `pyhlo serve`'s app
over an engine on a free loopback port (uvicorn in a thread, stopped at the end), the
official openai client, a bounded wait, and the text sample() gives a prompt alone.

    engine = Engine(batched_model(path, n_positions=256, context_length_estimate=[32, 64]), "m").start()
    with serving(engine) as running:           # the server, then the engine, stop at the end
        openai_client(running.base).completions.create(model="m", prompt="Hi", max_tokens=4)
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

LINES = 4                  # batch lines of the tests' servers: a few requests run, the next ones wait


def batched_model(path: Any, lines: int = LINES, **shape: Any) -> Any:
    """A LlamaForSampling of `lines` continuous-batching lines, compiled and loaded; shape:
    from_pretrained's n_positions, context_length_estimate..."""
    from decoders import ContinuousBatchingConfig, LlamaForSampling, NeuronConfig

    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=lines))
    return LlamaForSampling.from_pretrained(path, batch_size=lines, neuron_config=config, **shape).to_neuron()


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Served:
    base: str                      # http://127.0.0.1:<port>
    engine: Any
    server: Any                    # the uvicorn.Server (a GracefulServer where a shutdown_timeout was given)
    thread: threading.Thread       # where server.run() runs


def serve(engine: Any, *, shutdown_timeout: float | None = None, port: int | None = None,
          **app_options: Any) -> Served:
    """A started server of create_app(engine, **app_options) on a loopback port, in a thread.
    shutdown_timeout: pyhlo serve's GracefulServer with that drain (SIGTERM tests); None:
    uvicorn's own Server."""
    import uvicorn

    from serving.openai_api import create_app
    from serving.shutdown import GracefulServer

    port = free_port() if port is None else port
    config = uvicorn.Config(create_app(engine, **app_options), host="127.0.0.1", port=port,
                            log_level="warning")
    server = uvicorn.Server(config) if shutdown_timeout is None else \
        GracefulServer(config, engine, shutdown_timeout=shutdown_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "the server started", seconds=30)
    assert thread.is_alive(), "the server stopped as it started"
    return Served(f"http://127.0.0.1:{port}", engine, server, thread)


@contextlib.contextmanager
def serving(engine: Any, **options: Any) -> Iterator[Served]:
    """serve(engine, **options); at the end the server stops, then the engine."""
    running = serve(engine, **options)
    try:
        yield running
    finally:
        running.server.should_exit = True
        running.thread.join(timeout=30)
        engine.stop()


def openai_client(base: str, api_key: str = "none", timeout: float = 60) -> Any:
    """The official openai client of the server at `base` (no retries: every error shows)."""
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key=api_key, timeout=timeout, max_retries=0)


def async_openai_client(base: str, api_key: str = "none", timeout: float = 120) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base + "/v1", api_key=api_key, timeout=timeout, max_retries=0)


def wait_for(condition: Callable[[], Any], what: str, seconds: float = 60) -> None:
    """Until condition() is true; fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.01)


@pytest.fixture(scope="module", name="alone")
def sample_alone(smollm2_gguf):
    """The text sample() gives a prompt alone (greedy, batch 1, no continuous batching)."""
    from decoders import LlamaForSampling

    model = LlamaForSampling.from_pretrained(smollm2_gguf, batch_size=1, n_positions=256,
                                             context_length_estimate=[32, 64]).to_neuron()
    tokenizer = model.tokenizer
    eos = set(model.eos_ids())

    def text(prompt_ids: list[int], max_tokens: int) -> str:
        out = model.sample([prompt_ids], sequence_length=len(prompt_ids) + max_tokens, top_k=1)
        new = [t for t in out[0, len(prompt_ids):].tolist() if t not in eos]
        return tokenizer.decode(new, skip_special_tokens=True)

    return model, text
