"""One prefill product of a GGUF block weight, timed each way pyhlo can run it on the CPU.

    python -m tools.bench.block_products --rows 128 --forms q4_0,q8_0

For each form and shape ([rows, k] x [n, k], default SmolLM2-1.7B's MLP products), the best
of --repeats runs of: the blocks widened to f32 in the program and XLA's dot (the exact mode's
prefill), widened to bf16 with f32 sums (which the exact mode may not use: it rounds), the
int8-activation matrix-vector kernel run at these rows, and the int8 GEMM kernel; in ms and
in integer or float operations per second (2 * rows * n * k).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from decoders.blocks.params import Kind, Param, Shard, Source
from decoders.lowering import XlaLowering
from pyhlo import compile_py_func
from pyhlo.dtypes import name_of_numpy
from pyhlo.ops import linalg

WAYS = ("f32", "bf16", "x8_matvec", "x8_gemm")
SHAPES = ((8192, 2048), (2048, 8192))   # [n, k]: SmolLM2-1.7B's gate/up and down products


def random_blocks(form: str, n: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Values, f16 scales (and f16 minimums for Q4_1) of a random weight in a block form."""
    values = (rng.integers(-128, 128, (n, k), dtype=np.int8) if form == "q8_0"
              else rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    scales = rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16)
    return [values, scales] + ([rng.uniform(-1e-2, 1e-2, (n, k // 32)).astype(np.float16)]
                               if form == "q4_1" else [])


def time_product(backend, form: str, rows: int, n: int, k: int, way: str, repeats: int) -> float:
    """Seconds for the best of `repeats` runs of one product."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((rows, k)).astype(np.float32), *random_blocks(form, n, k, rng)]
    param = Param("w", Kind.LINEAR, (n, k), Shard.COLUMN, Source(("w",)))

    def program(scribe):
        x, values, scales, *mins = [
            getattr(scribe, name_of_numpy(a.dtype))[a.shape].Parameter(parameter_number=i)
            for i, a in enumerate(arrays)]
        mins = mins[0] if mins else None
        if way in ("f32", "bf16"):
            lowering = XlaLowering(way, "out_in", head_dtype=way, gguf_blocks=(("w", form),))
            return lowering.linear(x, values, param, scale=scales, mins=mins, out_dtype="f32")
        if way == "x8_matvec":
            return linalg.matvec_blocks_kernel(x, values, scales, mins, int8_activations=True)
        return linalg.gemm_blocks_x8_kernel(x, values, scales, mins)

    executable = backend.compile(compile_py_func(program).SerializeToString())
    buffers = [backend.to_device(a) for a in arrays]
    backend.to_host(executable.run_buffers(buffers)[0])          # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        backend.to_host(executable.run_buffers(buffers)[0])
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="activation rows (prompt tokens)")
    parser.add_argument("--forms", default="q4_0,q8_0,q4_1", help="block forms, from q8_0,q4_0,q4_1")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"from {','.join(WAYS)}")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from runtime import cpu_kernels
    from runtime.select import get_backend

    if not cpu_kernels.register():
        raise SystemExit("pyhlo's CPU kernels are off: nothing to compare")
    backend = get_backend()
    for form in args.forms.split(","):
        for n, k in SHAPES:
            cells = []
            for way in args.ways.split(","):
                seconds = time_product(backend, form, args.rows, n, k, way, args.repeats)
                rate = 2 * args.rows * n * k / seconds / 1e9
                cells.append(f"{way} {seconds * 1e3:7.2f} ms {rate:6.1f} G/s")
            print(f"{form} [{args.rows}x{k}] x [{n}x{k}]: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
