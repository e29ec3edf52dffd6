"""Time the int8 GEMM of K-quant weights (runtime/kernels/gemm_kquants.cc) against the
int8-activation matrix-vector kernel (matvec_gguf.cc's _x8 targets) on the same product.

    python scripts/bench_kquant_gemm.py                          # Q4_K, Q6_K; 128 rows; MLP shapes
    python scripts/bench_kquant_gemm.py --types Q4_K --rows 1,2,4,8,16 --shapes 8192x2048

Each product runs as one XLA:CPU program on a weight of random blocks (valid f16 fields)
placed on the device once; the figure is the median over --repeats runs of --calls calls each,
in ms and in integer operations per second (2 * rows * n * k). A measurement, not a test: on
a shared machine take the medians of several runs. PYHLO_MATVEC_THREADS=1 measures one thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gguf_kernels import random_blocks  # noqa: E402

from pyhlo import compile_py_func  # noqa: E402
from pyhlo.ops import linalg  # noqa: E402
from runtime import cpu_kernels  # noqa: E402
from runtime.select import get_backend  # noqa: E402

WAYS = ("matvec", "gemm")


def time_product(ggml_type: str, rows: int, n: int, k: int, way: str, repeats: int, calls: int) -> float:
    """Median seconds of one product."""
    data = random_blocks(ggml_type, n, k)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)

    def program(scribe):
        x_value = scribe.f32[x.shape].Parameter(parameter_number=0)
        data_value = scribe.u8[data.shape].Parameter(parameter_number=1)
        if way == "gemm":
            return linalg.gemm_gguf_x8_kernel(x_value, data_value, ggml_type)
        return linalg.matvec_gguf_kernel(x_value, data_value, ggml_type, int8_activations=True)

    backend = get_backend()
    executable = backend.compile(compile_py_func(program).SerializeToString())
    buffers = [backend.to_device(x), backend.to_device(data)]
    for _ in range(2):
        backend.to_host(executable.run_buffers(buffers)[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = executable.run_buffers(buffers)
        backend.to_host(out[0])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--rows", default="128", help="activation rows, comma-separated")
    parser.add_argument("--shapes", default="2048x8192,8192x2048",
                        help="weight shapes n x k, comma-separated (SmolLM2-1.7B's down and gate/up)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    assert cpu_kernels.register(), "the CPU kernels did not build"
    if not cpu_kernels.k_quant_int8_gemm_is_fast():
        print("this CPU lacks AVX-512 VNNI: the GEMM runs its portable form", flush=True)
    print(f"{'type':6} {'rows':>4} {'n x k':>11} " + " ".join(f"{way + ' ms':>10} {'G/s':>6}" for way in WAYS)
          + f" {'speedup':>7}")
    for ggml_type in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            for rows in map(int, args.rows.split(",")):
                seconds = [time_product(ggml_type, rows, n, k, way, args.repeats, args.calls) for way in WAYS]
                cells = " ".join(f"{s * 1e3:10.2f} {2 * rows * n * k / s / 1e9:6.1f}" for s in seconds)
                speedup = seconds[0] / seconds[1]
                print(f"{ggml_type:6} {rows:4} {shape:>11} {cells} {speedup:7.2f}", flush=True)


if __name__ == "__main__":
    main()
