"""Calibration of pyhlo's CPU kernels: which products run on the matrix-vector kernel on
this machine, decided by timing it against XLA's dot.

The kernel reads each weight row once for all activation rows, so it wins where a product
is bound by streaming the weights: a decode step at a small batch size. How small depends
on the CPU (its bandwidth, its vector units, XLA's own code for it): constants measured on
one host chose the slower path on another. So the choice is measured here, once per CPU
model and kernel build: for each weight type ("f32", "bf16", "s8" per-row int8, "blocks"
the GGUF Q4_1 form, whose rows every GGUF block kernel takes) and 1, 2, 4 and 8 activation
rows, the kernel and XLA's dot each run a chain of products over weights of a decoder MLP's
shape. Each timed run reads weights that are not in the caches: the chain is run over one of
several copies of its weights, in turn, together more than twice the last-level cache (some
hosts have hundreds of MB of it: one measured on a 480 MB cache timed the products in the
cache, at twice the speed the same products had in a model that does not fit).

A type's kernel rows are a range, from the first count at which the kernel wins by more
than 5% to the last one before it loses by more than 5% (none: XLA's dot always); a product
whose row count lies in the range takes the kernel. A range need not start at one row: on
a host where XLA's dot streams one row fast but two rows slowly, the kernel takes 2 to 8.
The table is kept as JSON beside the kernel library (runtime.cpu_kernels.kernel_dir()) and
read from there afterwards; PYHLO_MATVEC_MAX_ROWS="f32=4,bf16=2-8,s8=8,blocks=8" sets it
instead of measuring (N: rows 1 to N; A-B: rows A to B; 0: never).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import tempfile
import time
from typing import Any, Callable

import numpy as np

from decoders.blocks.params import Kind, Param, Shard, Source
from decoders.lowering import CpuKernelLowering, XlaLowering
from pyhlo import compile_py_func
from pyhlo.dtypes import name_of_numpy, numpy_dtype
from pyhlo.ops import elementwise as ew

log = logging.getLogger("pyhlo")

TYPES = ("f32", "bf16", "s8", "blocks")
ROWS = (1, 2, 4, 8)
SHAPE = (1536, 576)        # [out, in] of a small decoder's MLP products
CHAIN_BYTES = 48 << 20     # weights per timed program
MAX_COPIES = 32            # copies of a chain's weights run in turn, to leave the caches cold
RULE = 2                   # the measuring rule; a table kept under an older one is measured again
ENV = "PYHLO_MATVEC_MAX_ROWS"
MARGIN = 0.05


Rows = tuple[int, int]     # (first, last) activation rows that take the kernel; (0, 0): none


def parse(text: str) -> dict[str, Rows]:
    """'f32=4,bf16=2-8,s8=8,blocks=0' -> kernel rows per weight type (every type named)."""
    table = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        first, dash, last = value.strip().partition("-")
        if not dash:
            first, last = ("1", first) if first != "0" else ("0", "0")
        if (name not in TYPES or not first.isdigit() or not last.isdigit()
                or not (int(first) == int(last) == 0 or 1 <= int(first) <= int(last))):
            raise ValueError(f"{ENV}={text!r}: expected TYPE=ROWS or TYPE=FIRST-LAST items for each of "
                             f"{', '.join(TYPES)}, e.g. 'f32=4,bf16=2-8,s8=8,blocks=8'; got {item!r}")
        table[name] = (int(first), int(last))
    if set(table) != set(TYPES):
        raise ValueError(f"{ENV}={text!r} must name every weight type: {', '.join(TYPES)}")
    return table


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def table_path(library: pathlib.Path) -> pathlib.Path:
    """Where the measured table for this kernel build lives (the library's name already
    hashes the sources, the compiler flags, jaxlib and the CPU's features)."""
    return library.with_name(f"{library.stem}.paths.json")


def kernel_rows(backend: Any) -> dict[str, Rows]:
    """The kernel's rows per weight type on this machine: from PYHLO_MATVEC_MAX_ROWS, else
    the table measured earlier, else measured now (and kept)."""
    if os.environ.get(ENV):
        return parse(os.environ[ENV])
    from runtime import cpu_kernels

    path = table_path(cpu_kernels.build())
    try:
        # The limits follow from the kept timings, so a change of limit rule needs no new measurement.
        kept = json.loads(path.read_text())
        if kept.get("rule") != RULE:
            raise ValueError("measured under an older rule")
        timings = kept["microseconds"]
        return {kind: range_from({int(r): tuple(t) for r, t in timings[kind].items()}) for kind in TYPES}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    logging.getLogger("pyhlo.progress").info("timing pyhlo's matrix-vector kernel against XLA's dot on this "
                                             "CPU (once, about 30 s) ...")
    started = time.perf_counter()
    timings = measure(backend)
    table = {kind: range_from(rows) for kind, rows in timings.items()}
    record = {"cpu": _cpu_model(), "rule": RULE, "kernel_rows": table, "shape": list(SHAPE),
              "last_level_cache_bytes": last_level_cache_bytes(),
              "microseconds": {kind: {str(r): t for r, t in rows.items()} for kind, rows in timings.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".part") as f:
        json.dump(record, f, indent=1)
    os.replace(f.name, path)
    log.info("kernel rows on %s: %s (%.0f s)", record["cpu"] or "this CPU", format_table(table),
             time.perf_counter() - started)
    return table


def last_level_cache_bytes() -> int:
    """The largest CPU cache, in bytes (0 when the system does not say)."""
    sizes = []
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            sizes.append(int(os.sysconf(name)))
        except (ValueError, OSError):
            pass
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = index.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            pass
    return max([0, *sizes])


def copies_for(chain_bytes: int, cache_bytes: int) -> int:
    """How many copies of a chain's weights, run in turn, read more than twice the cache."""
    return max(2, min(MAX_COPIES, -(-2 * cache_bytes // max(1, chain_bytes)) + 1))


def range_from(times: dict[int, tuple[float, float]]) -> Rows:
    """(first, last): from the first row count at which the kernel (first time) beats XLA's
    dot (second) by more than MARGIN to the last such count before one where it loses by more
    than MARGIN. A near tie (timings move by a few percent) neither counts as a win nor ends
    the range, so a tie at one row does not give up a clear win at four (as on an AVX2 host,
    f32: 162 vs 160 us at one row, 251 vs 381 at four)."""
    first = last = 0
    for rows in sorted(times):
        kernel, xla = times[rows]
        if kernel > xla * (1 + MARGIN) and first:
            break
        if kernel < xla * (1 - MARGIN):
            first, last = first or rows, rows
    return first, last


def format_table(table: dict[str, Rows]) -> str:
    """'f32 rows 2-8, bf16 rows 1-2, s8 none, ...'."""
    return ", ".join(f"{kind} " + (f"rows {a}-{b}" if a else "none") for kind, (a, b) in table.items())


def measure(backend: Any, shape: tuple[int, int] = SHAPE, chain_bytes: int = CHAIN_BYTES,
            rows: tuple[int, ...] = ROWS, repeats: int = 7) -> dict[str, dict[int, tuple[float, float]]]:
    """Microseconds per product, (kernel, XLA's dot), by weight type and activation rows.
    The two run in turns and each keeps its fastest run, so that other work on the machine
    (a build, a test run) slows both alike instead of deciding the choice."""
    timings: dict[str, dict[int, tuple[float, float]]] = {}
    for kind in TYPES:
        timings[kind] = {}
        for r in rows:
            runs = [_chain(backend, kind, r, shape, chain_bytes, kernel) for kernel in (True, False)]
            best = [float("inf")] * 2
            for _ in range(repeats):
                for i, run in enumerate(runs):
                    best[i] = min(best[i], run())
            timings[kind][r] = (best[0], best[1])
    return timings


def _weights(kind: str, shape: tuple[int, int], count: int,
             rng: np.random.Generator) -> list[list[np.ndarray]]:
    n, k = shape
    made = []
    for _ in range(count):
        if kind == "f32":
            made.append([rng.standard_normal(shape).astype(np.float32)])
        elif kind == "bf16":
            made.append([rng.standard_normal(shape).astype(numpy_dtype("bf16"))])
        elif kind == "s8":
            made.append([rng.integers(-127, 128, shape, dtype=np.int8), rng.random(n).astype(np.float32)])
        else:
            made.append([rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                         rng.random((n, k // 32)).astype(np.float16),
                         rng.random((n, k // 32)).astype(np.float16)])
    return made


def _chain(backend: Any, kind: str, rows: int, shape: tuple[int, int], chain_bytes: int,
           kernel: bool) -> Callable[[], float]:
    """A compiled chain of products (the kernel's or XLA's dot), and a function that runs it
    once and returns microseconds per product."""
    dtype = "bf16" if kind == "bf16" else "f32"
    blocks = (("w", "q4_1"),) if kind == "blocks" else ()
    everything = {k: (1, max(ROWS)) for k in TYPES}
    lowering = (CpuKernelLowering(dtype, head_dtype=dtype, gguf_blocks=blocks,
                                  kernel_rows=tuple(everything.items()))
                if kernel else XlaLowering(dtype, "out_in", head_dtype=dtype, gguf_blocks=blocks))
    param = Param("w", Kind.LINEAR, shape, Shard.COLUMN, Source(("w",)), quant="s8" if kind == "s8" else None)
    rng = np.random.default_rng(0)
    one = sum(a.nbytes for a in _weights(kind, shape, 1, rng)[0])
    weights = _weights(kind, shape, max(1, chain_bytes // one), rng)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    arrays = [x, *(a for w in weights for a in w)]

    def program(scribe):
        params = [getattr(scribe, name_of_numpy(a.dtype))[a.shape].Parameter(parameter_number=i)
                  for i, a in enumerate(arrays)]
        h, at, total = ew.convert(params[0], dtype), 1, None
        for w in weights:
            parts = params[at:at + len(w)]
            at += len(w)
            y = lowering.linear(h, parts[0], param, scale=parts[1] if len(parts) > 1 else None,
                                mins=parts[2] if len(parts) > 2 else None, out_dtype="f32")
            total = y if total is None else ew.add(total, y)
        return total

    executable = backend.compile(compile_py_func(program).SerializeToString())
    # Copies of the weights (the same values: only where they lie matters), run in turn, so
    # that a run's weights have left the caches since they were last read.
    chain = sum(a.nbytes for a in arrays[1:])
    copies = [[backend.to_device(a) for a in arrays]
              for _ in range(copies_for(chain, last_level_cache_bytes()))]
    turn = itertools.count()
    backend.to_host(executable.run_buffers(copies[0])[0])          # warm-up

    def run() -> float:
        buffers = copies[next(turn) % len(copies)]
        started = time.perf_counter()
        backend.to_host(executable.run_buffers(buffers)[0])
        return (time.perf_counter() - started) / len(weights) * 1e6

    return run
