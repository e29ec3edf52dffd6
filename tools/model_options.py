"""The options that say which model to build, shared by the commands that build one."""
from __future__ import annotations

import argparse


def int_list(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {value!r}") from None


def add_quant_argument(group) -> None:
    group.add_argument("--quant", choices=["s8"],
                       help="store the layers' linear weights quantized: s8 = int8 with one scale per output "
                            "row (transformers-neuronx's QuantizationConfig(quant_dtype='s8')); default: none "
                            "(a GGUF file's Q8_0, Q4_0 and Q4_1 weights still run as stored)")
    group.add_argument("--widen-gguf", action="store_true",
                       help="widen a GGUF file's Q8_0, Q4_0 and Q4_1 weights to the --amp type at load instead "
                            "of running them in their blocks as stored")
    group.add_argument("--int8-activations", action="store_true",
                       help="a GGUF file's Q8_0 / Q4_0 / Q4_1 products on pyhlo's CPU kernels round the "
                            "activations to int8 per 32 values and multiply integers, as llama.cpp does "
                            "(faster; within the rounding of the exact product)")
    group.add_argument("--kv-cache-quant", action="store_true",
                       help="keep the KV caches as int8 with an f32 scale per slot and head (about a quarter "
                            "of f32 caches' bytes, half of bf16's)")


def weight_options(args: argparse.Namespace) -> dict:
    """The NeuronConfig settings --quant, --widen-gguf, --int8-activations and --kv-cache-quant ask for."""
    options = {"gguf_blocks": False if getattr(args, "widen_gguf", False) else None,
               "kv_cache_quant": bool(getattr(args, "kv_cache_quant", False)),
               "int8_activations": bool(getattr(args, "int8_activations", False))}
    if getattr(args, "quant", None) is not None:
        from decoders import QuantizationConfig

        options["quant"] = QuantizationConfig(quant_dtype=args.quant)
    return options


def add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """--batch-size, --n-positions, --amp, --quant and --context-length-estimate."""
    group.add_argument("--batch-size", type=int, default=1, metavar="N", help="batch size (default 1)")
    group.add_argument("--n-positions", type=int, default=1024, metavar="N",
                       help="longest sequence; token buckets are powers of two up to it (default 1024)")
    group.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"],
                       help="weights and activations type (default f32)")
    add_quant_argument(group)
    group.add_argument("--context-length-estimate", type=int_list, metavar="N[,N]",
                       help="prefill buckets, e.g. 64,256 (default: half of each token bucket)")
