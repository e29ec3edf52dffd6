"""The options that say which model to build, shared by the commands that build one.

Today's names come first; the spellings HF, vLLM and llama.cpp users type are aliases beside
them: -m / --model or a positional MODEL, --dtype for --amp, --max-model-len for --n-positions.
"""
from __future__ import annotations

import argparse
import os

# --amp / --dtype: pyhlo's names, and the torch names HF and vLLM users type.
AMP_NAMES = {"f32": "f32", "float32": "f32", "float": "f32", "bf16": "bf16", "bfloat16": "bf16",
             "f16": "f16", "float16": "f16", "half": "f16"}


def amp_name(value: str) -> str:
    """'bfloat16' -> 'bf16' (and the other torch names); pyhlo's own names as they are."""
    try:
        return AMP_NAMES[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown type {value!r}; use f32, bf16 or f16 (or float32, "
                                         "bfloat16, float16)") from None


def add_model_argument(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    """The model as `-m PATH`, `--model PATH` or (positional) a first MODEL argument; read it
    back with model_path(args)."""
    if positional:
        parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                            help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct); "
                                 "or give it as -m / --model")
    parser.add_argument("-m", "--model", metavar="PATH",
                        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")


def model_path(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or -m / --model (None: the default model); both given must agree."""
    given = getattr(args, "model_positional", None)
    if given is not None and args.model is not None and given != args.model:
        raise ValueError(f"two models given: {given} and --model {args.model}; give one")
    return args.model if args.model is not None else given


def add_amp_argument(group, default: str = "f32", help: str = "weights and activations type") -> None:
    group.add_argument("--amp", "--dtype", dest="amp", default=default, type=amp_name,
                       choices=["f32", "bf16", "f16"],
                       help=f"{help} (default {default}; also bfloat16, float16, float32)")


def add_n_positions_argument(group, default: int = 1024,
                             help: str = "longest sequence; token buckets are powers of two up to it",
                             ) -> None:
    group.add_argument("--n-positions", "--max-model-len", dest="n_positions", type=int, default=default,
                       metavar="N", help=f"{help} (default {default})")


def add_tp_degree_argument(group) -> None:
    group.add_argument("--tp-degree", type=int, default=1, metavar="N",
                       help="tensor parallelism: the model split over N devices (default 1; on CPU, N host "
                            "devices are made for it)")


def cpu_devices_for(tp_degree: int) -> None:
    """XLA:CPU shows one device unless told so before it starts: ask for `tp_degree` of them
    (where XLA_FLAGS does not already say how many). Other platforms are not affected."""
    flags = os.environ.get("XLA_FLAGS", "")
    if tp_degree > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp_degree}".strip()


def int_list(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {value!r}") from None


def add_quant_argument(group) -> None:
    group.add_argument("--quant", choices=["s8"],
                       help="store the layers' linear weights quantized: s8 = int8 with one scale per output "
                            "row (transformers-neuronx's QuantizationConfig(quant_dtype='s8')); default: "
                            "none (a GGUF file's quantized weights still run as stored: Q8_0, Q4_0, Q4_1, "
                            "Q5_0, Q5_1, the K-quants, IQ4_NL, IQ4_XS)")
    group.add_argument("--widen-gguf", action="store_true",
                       help="widen a GGUF file's quantized weights to the --amp type at load "
                            "instead of running them in their blocks as stored")
    group.add_argument("--int8-activations", action="store_true",
                       help="a GGUF file's Q8_0 / Q4_0 / Q4_1 and K-quant products on pyhlo's CPU kernels "
                            "round the activations to int8 (per 32 values; K-quants per 256) and multiply "
                            "integers, as llama.cpp does (faster; within the rounding of the exact product); "
                            "with --quant s8, a prompt's products the same way (per 32 values)")
    group.add_argument("--kv-cache-quant", action="store_true",
                       help="keep the KV caches as int8 with an f32 scale per slot and head (about a quarter "
                            "of f32 caches' bytes, half of bf16's)")
    group.add_argument("--kv-cache-dtype", choices=("f32", "bf16"),
                       help="the KV caches' element type (default: the --amp type); bf16 halves an f32 "
                            "model's cache bytes, as llama.cpp's f16 caches")


def weight_options(args: argparse.Namespace) -> dict:
    """The NeuronConfig settings --quant, --widen-gguf, --int8-activations, --kv-cache-quant and
    --kv-cache-dtype ask for."""
    options = {"gguf_blocks": False if getattr(args, "widen_gguf", False) else None,
               "kv_cache_quant": bool(getattr(args, "kv_cache_quant", False)),
               "kv_cache_dtype": getattr(args, "kv_cache_dtype", None),
               "int8_activations": bool(getattr(args, "int8_activations", False))}
    if getattr(args, "quant", None) is not None:
        from decoders import QuantizationConfig

        options["quant"] = QuantizationConfig(quant_dtype=args.quant)
    return options


def add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """--batch-size, --n-positions (--max-model-len), --amp (--dtype), --quant and
    --context-length-estimate."""
    group.add_argument("--batch-size", type=int, default=1, metavar="N", help="batch size (default 1)")
    add_n_positions_argument(group)
    add_amp_argument(group)
    add_quant_argument(group)
    group.add_argument("--context-length-estimate", type=int_list, metavar="N[,N]",
                       help="prefill buckets, e.g. 64,256 (default: half of each token bucket)")
