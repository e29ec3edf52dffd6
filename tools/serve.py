"""Serve a model over an OpenAI-compatible HTTP API, many clients at once.

Requests share the batch's lines (continuous batching): a new request's prompt is written
into a free line while the others keep generating, and a finished or abandoned request
frees its line at once. Binds to 127.0.0.1 unless --host says otherwise.

endpoints:
  POST /v1/completions, POST /v1/chat/completions (streamed with "stream": true),
  GET /v1/models, GET /health, GET /metrics (Prometheus)

examples:
  pyhlo serve                                   # SmolLM2-135M-Instruct on port 8000, 4 lines
  pyhlo serve path/to/llama-dir --batch-size 8 --port 8080
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from tools.model_options import add_quant_argument, int_list, weight_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--batch-size", type=int, default=4, metavar="N",
                        help="batch lines: requests generated at the same time (default 4); more wait in a queue")
    parser.add_argument("--n-positions", type=int, default=1024, metavar="N",
                        help="context length: prompt + answer tokens of one request (default 1024)")
    parser.add_argument("--context-length-estimate", type=int_list, metavar="N[,N]",
                        help="prompt chunk sizes, e.g. 64,256 (default: half of each token bucket)")
    parser.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"], help="weights type (default f32)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: the file or folder name)")
    add_quant_argument(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from decoders import ContinuousBatchingConfig, NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path
    from serving.engine import Engine
    from serving.openai_api import create_app

    path = args.model or default_model_path()
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=args.batch_size),
                          **weight_options(args))
    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=args.batch_size, n_positions=args.n_positions,
                                                       amp=args.amp, context_length_estimate=args.context_length_estimate,
                                                       neuron_config=config)
    model.to_neuron()
    name = args.served_model_name or pathlib.Path(path).name
    engine = Engine(model, name).start()
    print(f"pyhlo serve: {name} on http://{args.host}:{args.port}/v1 ({args.batch_size} lines, context "
          f"{model.n_positions})", file=sys.stderr)
    try:
        uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()
    return 0
