"""Time pyhlo's CPU kernels on GGUF weights kept as the file's bytes (runtime/kernels/matvec_gguf.cc).

    python scripts/bench_gguf_kernels.py                        # Q4_K, Q5_K, Q6_K; 2048 x 8192; 1 row
    python scripts/bench_gguf_kernels.py --types Q6_K --rows 1,4 --x8 both
    python scripts/bench_gguf_kernels.py --x8 on --copies 24    # read from memory, not cache

Each product runs as one XLA:CPU program on a weight of random blocks (valid f16 fields),
placed on the device once; the figure is the median over --repeats runs of --calls calls
each, as ns per weight row and GB/s of weight bytes. --copies: that many weights of random
blocks, taken in turn and each call waited on, so that each call reads its weight from memory
(a decode step's case) rather than from cache. A measurement, not a test: on a shared machine
take the medians of several runs. PYHLO_MATVEC_THREADS=1 measures one thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyhlo import compile_py_func  # noqa: E402
from pyhlo.ops import linalg  # noqa: E402
from pyhlo.ops.gguf_blocks import LAYOUTS  # noqa: E402
from runtime import cpu_kernels  # noqa: E402
from runtime.select import get_backend  # noqa: E402

# Byte offsets of each form's f16 fields; random bytes elsewhere are valid blocks.
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(ggml_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values, size = LAYOUTS[ggml_type]
    data = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for start in HALVES[ggml_type]:
        halves = rng.uniform(1e-3, 1e-2, (n, k // values)).astype(np.float16)
        data[:, :, start:start + 2] = halves.reshape(n, k // values, 1).view(np.uint8)
    return data.reshape(n, -1)


def time_kernel(ggml_type: str, rows: int, n: int, k: int, x8: bool, repeats: int, calls: int,
                copies: int = 1) -> float:
    """Median seconds of one product."""
    weights = [random_blocks(ggml_type, n, k, seed) for seed in range(copies)]
    data = weights[0]
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)

    def program(scribe):
        return linalg.matvec_gguf_kernel(scribe.f32[x.shape].Parameter(parameter_number=0),
                                         scribe.u8[data.shape].Parameter(parameter_number=1), ggml_type,
                                         int8_activations=x8)

    backend = get_backend()
    executable = backend.compile(compile_py_func(program).SerializeToString())
    x_buffer = backend.to_device(x)
    buffers = [[x_buffer, backend.to_device(w)] for w in weights]
    for i in range(3):
        backend.to_host(executable.run_buffers(buffers[i % copies])[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            out = executable.run_buffers(buffers[i % copies])
            if copies > 1:   # each product waited on, as a decode step's are: runs do not overlap
                backend.to_host(out[0])
        backend.to_host(out[0])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    parser.add_argument("--rows", default="1", help="activation rows, comma-separated")
    parser.add_argument("--n", type=int, default=2048, help="weight rows")
    parser.add_argument("--k", type=int, default=8192, help="values per weight row")
    parser.add_argument("--x8", choices=("off", "on", "both"), default="off",
                        help="the int8-activation kernels (Q8_K activations)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--copies", type=int, default=1,
                        help="weights taken in turn (enough to pass the caches: read from memory)")
    args = parser.parse_args()
    assert cpu_kernels.register(), "the CPU kernels did not build"
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.x8]
    print(f"{'type':6} {'rows':>4} {'form':5} {'ms':>8} {'ns/row':>8} {'GB/s':>6}")
    for ggml_type in args.types.split(","):
        weight_bytes = args.n * args.k // LAYOUTS[ggml_type][0] * LAYOUTS[ggml_type][1]
        for rows in map(int, args.rows.split(",")):
            for x8 in modes:
                seconds = time_kernel(ggml_type, rows, args.n, args.k, x8, args.repeats, args.calls,
                                      args.copies)
                print(f"{ggml_type:6} {rows:4} {'x8' if x8 else 'exact':5} {seconds * 1e3:8.3f} "
                      f"{seconds / args.n * 1e9:8.1f} {weight_bytes / seconds / 1e9:6.2f}", flush=True)


if __name__ == "__main__":
    main()
