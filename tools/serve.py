"""Serve a model over an OpenAI-compatible HTTP API, many clients at once.

Requests share the batch's lines (continuous batching): a new request's prompt is written
into a free line while the others keep generating, and a finished or abandoned request
frees its line at once. Binds to 127.0.0.1 unless --host says otherwise.

endpoints:
  POST /v1/completions, POST /v1/chat/completions (streamed with "stream": true),
  GET /v1/models, GET /health (503 once the engine has stopped), GET /metrics (Prometheus)

A request that fails ends alone, as a 500 in OpenAI's error shape (an error event in a stream).

Among other servers: --api-key (or PYHLO_API_KEY) wants a Bearer key on every route but
/health; --max-waiting bounds the queue (429 with Retry-After past it); bodies over
--max-request-bytes get a 413; /metrics serves the waiting and running requests and the
KV-cache use an inference gateway balances replicas by. SIGTERM or Ctrl-C: no new requests
(503), the waiting ones fail, the running ones get --shutdown-timeout seconds to finish; a
second signal exits at once. /docs only with --enable-docs.

While it starts, a line on stderr names each step (reading the model, compiling, placing
the weights, loading the tokenizer); once it serves, a line per finished request (its id,
prompt and completion tokens, time, finish reason) unless --no-request-log.

examples:
  pyhlo serve                                   # SmolLM2-135M-Instruct on port 8000, 4 lines
  pyhlo serve path/to/llama-dir --batch-size 8 --port 8080
  pyhlo serve -m path/to/llama-dir --max-num-seqs 8 --max-model-len 2048 --dtype bf16
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any

from tools.model_options import (
    add_amp_argument,
    add_model_argument,
    add_n_positions_argument,
    add_quant_argument,
    add_tp_degree_argument,
    cpu_devices_for,
    int_list,
    model_path,
    weight_options,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int, default=4, metavar="N",
                        help="batch lines: requests generated at the same time (default 4); more wait in a "
                             "queue")
    add_n_positions_argument(parser, help="context length: prompt + answer tokens of one request")
    parser.add_argument("--context-length-estimate", type=int_list, metavar="N[,N]",
                        help="prompt chunk sizes, e.g. 64,256 (default: 8, 16, 32 and half of each token "
                             "bucket)")
    add_amp_argument(parser, help="weights type")
    add_tp_degree_argument(parser)
    parser.add_argument("--served-model-name",
                        help="the model's name in the API (default: the file or folder name)")
    parser.add_argument("--no-request-log", action="store_true",
                        help="no line on stderr per finished request (id, tokens, time, finish reason)")
    _add_guard_arguments(parser)
    add_quant_argument(parser)


def _add_guard_arguments(parser: argparse.ArgumentParser) -> None:
    """What keeps the server whole among other servers and clients."""
    from serving.limits import DEFAULT_MAX_REQUEST_BYTES
    from serving.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S

    parser.add_argument("--api-key", default=os.environ.get("PYHLO_API_KEY") or None,
                        help="clients must send 'Authorization: Bearer KEY' (the openai client's api_key) on "
                             "every route but /health and /metrics (default: $PYHLO_API_KEY; unset: no key)")
    parser.add_argument("--max-waiting", type=int, metavar="N",
                        help="at most N requests wait for a batch line; more get a 429 with Retry-After "
                             "(default: no bound)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help=f"larger request bodies get a 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 8 MiB)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM or Ctrl-C, how long running requests may still take before they "
                             f"are ended (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g} s); a second signal exits "
                             "at once")
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve the API's /docs and /openapi.json (off by default)")


# What a chat request computes is often a few tokens to a few dozen (the rest of its prompt a
# line kept, or copied, from an earlier request): chunks of 8, 16 and 32 keep it from running as a
# chunk of 64 or more. SmolLM2-135M, 8 lines, a burst of 7 chat requests whose last 5-8 tokens are
# new: their chunks of 8 together 115-120 ms, of 16 240-260 ms (Zen 3, 2 cores).
SHORT_CHUNKS = (8, 16, 32)


def serving_chunks(n_positions: int) -> list[int]:
    """The prompt chunk sizes pyhlo serve compiles by default: SHORT_CHUNKS and half of each token
    bucket, as far as the context allows."""
    from decoders.programs.buckets import context_buckets, token_buckets

    usual = context_buckets(token_buckets(n_positions))
    return sorted({c for c in SHORT_CHUNKS if c < usual[0]} | set(usual))


def _phase(what: str) -> None:
    """One line on stderr as a start-up step that can take seconds begins."""
    print(f"pyhlo serve: {what} ...", file=sys.stderr, flush=True)


def build_engine(args: argparse.Namespace) -> Any:
    """The model compiled and loaded, its tokenizer read, and the engine (not started) over it;
    a line on stderr for each step."""
    from decoders import ContinuousBatchingConfig, NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path
    from serving.engine import Engine

    cpu_devices_for(args.tp_degree)              # before the backend starts
    path = model_path(args) or default_model_path()
    config = NeuronConfig(
        continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=args.batch_size),
        **weight_options(args))
    _phase(f"reading {path}")
    chunks = args.context_length_estimate or serving_chunks(args.n_positions)
    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=args.batch_size,
                                                       n_positions=args.n_positions,
                                                       tp_degree=args.tp_degree, amp=args.amp,
                                                       context_length_estimate=chunks,
                                                       neuron_config=config)
    _phase(f"compiling {len(model.eager_programs())} programs (from the compile cache when built before)")
    # Compiled here so that its line comes before the weights'; to_neuron() then compiles nothing.
    model.session.compile()
    _phase("placing the weights")
    model.to_neuron()
    _phase("loading the tokenizer")
    return Engine(model, args.served_model_name or pathlib.Path(path).name,         # reads the tokenizer
                  max_waiting=args.max_waiting)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from serving.engine import show_request_log
    from serving.openai_api import create_app
    from serving.shutdown import GracefulServer

    started = time.perf_counter()
    show_request_log(not args.no_request_log)
    engine = build_engine(args).start()
    print(f"pyhlo serve: {engine.name} on http://{args.host}:{args.port}/v1 ({args.batch_size} lines, "
          f"context {engine.n_positions}; ready in {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    app = create_app(engine, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     docs=args.enable_docs)
    try:
        GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"), engine,
                       shutdown_timeout=args.shutdown_timeout).run()
    finally:
        engine.stop()
    return 0
