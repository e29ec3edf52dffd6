"""Decode products on GGUF weights kept as the file's bytes, timed as memory streams.

    python -m tools.bench.gguf_matvec --forms Q4_K,Q6_K --threads 1,2

One program chains `--layers` pairs of products as a decoder's MLP does, x[rows, 2048] by a
[8192, 2048] weight, then by a [2048, 8192] one (SmolLM2-1.7B's shapes), each layer its own
weights: several hundred MB in all, so that every product reads its weight from memory, not
from cache. A tanh between products keeps the values finite. Reported: the best of --repeats
runs, in weight bytes read per second (GB/s), and per product. The thread counts are given to
the kernels by PYHLO_MATVEC_THREADS, which they read once: each count runs in a process of its
own.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = ((8192, 2048), (2048, 8192))   # [n, k]: a gate/up product, then a down product


def random_blocks(ggml_type: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A weight [n, k] as random blocks of `ggml_type`, u8 [n, k / values * bytes], every f16
    field a small finite number."""
    from pyhlo.ops.gguf_blocks import LAYOUTS

    values, size = LAYOUTS[ggml_type]
    data = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    # Offsets of the f16 scale (and minimum) fields in each block.
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}[ggml_type]
    for start in halves:
        scale = rng.uniform(1e-4, 1e-3, (n, k // values)).astype(np.float16)
        data[:, :, start:start + 2] = scale.reshape(n, -1, 1).view(np.uint8)
    return data.reshape(n, -1)


def time_chain(ggml_type: str, rows: int, layers: int, repeats: int,
               int8_activations: bool) -> tuple[float, int]:
    """Seconds for the best of `repeats` runs of the chain, and the weight bytes it reads."""
    from pyhlo import compile_py_func
    from pyhlo.ops import linalg
    from pyhlo.ops.elementwise import tanh
    from runtime.select import get_backend

    backend = get_backend()
    rng = np.random.default_rng(0)
    weights = [random_blocks(ggml_type, n, k, rng) for _ in range(layers) for n, k in SHAPES]
    x = rng.standard_normal((rows, SHAPES[0][1])).astype(np.float32)

    def program(scribe):
        h = scribe.f32[x.shape].Parameter(parameter_number=0)
        for i, w in enumerate(weights):
            data = scribe.u8[w.shape].Parameter(parameter_number=i + 1)
            h = tanh(linalg.matvec_gguf_kernel(h, data, ggml_type, int8_activations=int8_activations))
        return h

    executable = backend.compile(compile_py_func(program).SerializeToString())
    buffers = [backend.to_device(a) for a in [x, *weights]]
    backend.to_host(executable.run_buffers(buffers)[0])          # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        backend.to_host(executable.run_buffers(buffers)[0])
        best = min(best, time.perf_counter() - started)
    return best, sum(w.nbytes for w in weights)


def measure(args: argparse.Namespace) -> None:
    """One thread count (set in this process's environment): every form, one line each."""
    from runtime import cpu_kernels

    if not cpu_kernels.register():
        raise SystemExit("pyhlo's CPU kernels are off: nothing to measure")
    for ggml_type in args.forms.split(","):
        seconds, nbytes = time_chain(ggml_type, args.rows, args.layers, args.repeats, not args.exact)
        threads = os.environ.get("PYHLO_MATVEC_THREADS", "all")
        print(f"{ggml_type} {'exact' if args.exact else 'x8'} rows={args.rows} threads={threads}: "
              f"{nbytes / seconds / 1e9:6.1f} GB/s ({nbytes / 1e6:.0f} MB in {seconds * 1e3:.1f} ms, "
              f"{seconds / (2 * args.layers) * 1e6:.0f} us a product)", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default="Q4_K,Q6_K,Q5_K", help="GGML types, from Q2_K ... Q6_K")
    parser.add_argument("--rows", type=int, default=1, help="activation rows (sequences decoded at once)")
    parser.add_argument("--layers", type=int, default=12, help="pairs of products, each its own weights")
    parser.add_argument("--threads", default="1,2", help="thread counts, each in a process of its own")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--exact", action="store_true", help="the exact kernels (f32 activations), not _x8")
    parser.add_argument("--one-count", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_count:
        measure(args)
        return
    for threads in args.threads.split(","):
        env = dict(os.environ, PYHLO_MATVEC_THREADS=threads)
        command = [sys.executable, "-m", "tools.bench.gguf_matvec", "--one-count", "--forms", args.forms,
                   "--rows", str(args.rows), "--layers", str(args.layers), "--repeats", str(args.repeats)]
        subprocess.run(command + (["--exact"] if args.exact else []), env=env, check=True)


if __name__ == "__main__":
    main()
