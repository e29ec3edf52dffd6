"""The machine a benchmark runs on: what it is (CPU, versions, device), how fast it reads memory,
and how much of it other processes take while we measure.

Nothing here touches jax in this process: a jax client on a GPU takes most of the GPU's
memory for itself, which the benchmark's workers need. jax's devices are looked up in a
short child process instead.
"""
from __future__ import annotations

import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tools.bench.worker import Worker


# -- the CPU and its memory ------------------------------------------------------------
def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (none where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (hosts that all say "AMD EPYC" differ
    there: family 25 model 1 is Zen 3, family 25 model 17 Zen 4, family 26 Zen 5)."""
    fields = _cpuinfo()
    name = fields.get("model name") or platform.processor() or "?"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def machine_info() -> dict:
    import psutil

    fields = _cpuinfo()
    cpu = fields.get("model name") or platform.processor() or "?"
    flags = set(fields.get("flags", "").split())
    versions = {"python": platform.python_version()}
    for package in ("numpy", "jaxlib", "torch", "transformers", "llama-cpp-python"):
        version = _version(package)
        if version:
            versions[package] = version
    return {
        "cpu": cpu, "cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "fma"}),
        "memory_gib": psutil.virtual_memory().total / 2**30, "platform": platform.platform(),
        "versions": versions,
    }


def measure_bandwidth(array_mb: int, threads: int, repeats: int = 7) -> dict:
    """Sustained memory read bandwidth over one large float32 array, two ways:

      threaded sum  `threads` threads each summing a part (numpy releases the GIL there);
      matvec        the array as a matrix times a vector through numpy's BLAS (its own
                    threads): the access pattern of a decode step.

    The faster median is the bandwidth the roofline uses.
    """
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(array_mb * 2**20 // 4, np.float32)
    parts = np.array_split(data, threads)
    columns = 4096 if data.size % 4096 == 0 else 1
    matrix, vector = data.reshape(-1, columns), np.ones(columns, np.float32)

    def rate(read) -> list[float]:
        samples = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            read()
            samples.append(data.nbytes / (time.perf_counter() - started) / 1e9)
        return samples[1:]  # the first pass warms the caches and the threads

    with ThreadPoolExecutor(threads) as pool:
        probes = {"threaded sum": rate(lambda: list(pool.map(np.sum, parts))),
                  "matvec": rate(lambda: matrix @ vector)}
    medians = {name: float(np.median(samples)) for name, samples in probes.items()}
    best = max(medians, key=medians.get)
    return {"gb_per_s": medians[best], "method": best, "samples_gb_per_s": probes[best],
            "probes_gb_per_s": medians, "array_mb": array_mb, "threads": threads}


def measure_matmul_rate(threads: int, size: int = 2048, repeats: int = 5) -> dict:
    """The f32 FLOP rate of a large matrix product (torch's, over `threads` threads): what the
    CPU reaches on dense f32 work, against which a prefill's rate is given."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        samples = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            torch.mm(a, b)
            samples.append(2 * size**3 / (time.perf_counter() - started) / 1e9)
    finally:
        torch.set_num_threads(before)
    return {"gflop_per_s": float(np.median(samples[1:])), "method": f"torch f32 matmul {size}x{size}x{size}",
            "samples_gflop_per_s": samples[1:], "threads": threads}


# -- a device: CUDA for torch and jax, its name and copy rate --------------------------
DEVICES = ("cpu", "cuda")
TORCH_CUDA_HINT = ("install torch with CUDA from PyTorch's own wheels, e.g. pip install torch --index-url "
                   "https://download.pytorch.org/whl/cu130 (the index for your driver's CUDA version: "
                   "https://pytorch.org/get-started/locally/)")
JAX_CUDA_HINT = ("install jax's CUDA plugin: pip install -e '.[cuda]' in pyhlo's checkout "
                 "('.[cuda12]' for drivers older than CUDA 13)")
# Asks jax for its CUDA devices through pyhlo's runtime, which names the fix when there are none.
_JAX_CUDA_PROBE = "from runtime import pjrt; print(len(pjrt.devices('cuda')))"


class DeviceMissing(ValueError):
    """The device asked for is not usable here; the message says what to install."""


def torch_cuda_problem() -> str | None:
    """None if torch can run on a CUDA GPU, else what is wrong and how to fix it."""
    try:
        import torch
    except ImportError:
        return f"torch is not installed: {TORCH_CUDA_HINT}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA: {TORCH_CUDA_HINT}"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the NVIDIA driver "
                "(nvidia-smi) and CUDA_VISIBLE_DEVICES")
    return None


def jax_cuda_problem(root: str) -> str | None:
    """None if jax (as pyhlo's runtime uses it) has CUDA devices, else what is wrong and how to fix it."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]]
                                                    if os.environ.get("PYTHONPATH") else [])))
    probe = subprocess.run([sys.executable, "-c", _JAX_CUDA_PROBE], capture_output=True, text=True, env=env,
                           cwd=root, timeout=300)
    if probe.returncode == 0 and probe.stdout.strip() not in ("", "0"):
        return None
    errors = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    detail = errors[-1] if errors else f"exit code {probe.returncode}"
    return f"jax has no CUDA devices: {detail}" + ("" if "pip install" in detail else f"; {JAX_CUDA_HINT}")


def check_device(device: str, root: str) -> None:
    """Raise DeviceMissing, naming every missing piece, unless torch and jax can both use `device`."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return
    problems = [p for p in (torch_cuda_problem(), jax_cuda_problem(root)) if p]
    if problems:
        raise DeviceMissing("--device cuda needs an NVIDIA GPU that both torch (the HF engines) and jax "
                            "(pyhlo) can use; nothing falls back to the CPU. Missing here:\n  - "
                            + "\n  - ".join(problems))


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return machine_info()["cpu"]


def cuda_copy_bandwidth(gib: float = 1.0, repeats: int = 10) -> dict:
    """Device-to-device copy rate of a `gib` GiB tensor on GPU 0, timed with CUDA events.

    A copy reads every byte once and writes it once, so the rate counts both: bytes moved
    per second, the figure a memory-bound kernel's traffic is compared with.
    """
    import torch

    size = int(gib * 2**30)
    source = torch.ones(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)  # the first copy pays for whatever is lazily set up
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        samples.append(2 * size / (start.elapsed_time(end) / 1e3) / 1e9)
    del source, target
    torch.cuda.empty_cache()
    return {"gb_per_s": statistics.median(samples), "method": "device-to-device copy (bytes read + written)",
            "samples_gb_per_s": samples, "array_mb": size / 2**20}


def measure_device_bandwidth(device: str, threads: int, cpu_array_mb: int = 512) -> dict:
    """The device's memory bandwidth: a GPU's copy rate, or the CPU's read rate (measure_bandwidth)."""
    if device == "cuda":
        return cuda_copy_bandwidth()
    return measure_bandwidth(cpu_array_mb, threads)


# -- other processes -------------------------------------------------------------------
QUIET_PERCENT = 15.0  # system-wide CPU use (% of all cores) below which the machine counts as idle
DISTURBED = 0.10  # share of the machine other processes may take during a generation we keep
RETRIES = 2  # generations repeated at most this often when other processes disturbed them


def _system_busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    # guest time is already counted in user time; steal (the hypervisor's other guests) is not ours
    return (sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
            - getattr(t, "guest_nice", 0.0))


def _own_seconds() -> float:
    """CPU time of this process and of its finished (reaped) children."""
    own = os.times()
    return own.user + own.system + own.children_user + own.children_system


class OtherLoad:
    """How much CPU other processes take while we measure; waiting for them to stop.

    Timings on a shared machine are only as good as its quiet: a second process on one of
    two cores stalls every multi-threaded engine at each barrier. Other processes' use is
    the system's busy time minus ours: this process, its finished workers, and the worker
    that ran (it reports its own CPU time).
    """

    def __init__(self, max_wait: float):
        self.max_wait = max_wait
        self.busy_starts = 0
        self.retries = 0

    @staticmethod
    def mark() -> tuple[float, float, float]:
        return time.perf_counter(), _system_busy_seconds(), _own_seconds()

    @staticmethod
    def other_since(mark: tuple[float, float, float], worker_cpu_s: float = 0.0) -> dict:
        wall, busy, own = (b - a for a, b in zip(mark, OtherLoad.mark()))
        other = max(0.0, busy - own - worker_cpu_s)
        return {"other_cpu_seconds": other, "wall_seconds": wall,
                "other_cpu_fraction": other / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0}

    def start(self) -> None:
        self.busy_starts = self.retries = 0
        self._start = self.mark()

    def stop(self) -> dict:
        """Other processes' CPU use since start() (all workers reaped by then)."""
        return {**self.other_since(self._start), "busy_starts": self.busy_starts, "retries": self.retries}

    def wait(self) -> None:
        """Return once the CPUs are idle (our workers are idle between requests), or after max_wait."""
        import psutil

        if self.max_wait <= 0:
            return
        deadline = time.perf_counter() + self.max_wait
        while psutil.cpu_percent(interval=0.5) >= QUIET_PERCENT:
            if time.perf_counter() > deadline:
                self.busy_starts += 1
                return

    def generate(self, worker: Worker, prompts: list[list[int]], new_tokens: int) -> dict:
        """One generation on a quiet machine: repeated (at most RETRIES times) when other
        processes took more than DISTURBED of the CPUs meanwhile."""
        for attempt in range(RETRIES + 1):
            self.wait()
            mark = self.mark()
            record = worker.call("generate", prompts=prompts, new_tokens=new_tokens)
            record["other_cpu_fraction"] = self.other_since(mark, record["cpu_s"])["other_cpu_fraction"]
            if record["other_cpu_fraction"] <= DISTURBED or attempt == RETRIES or self.max_wait <= 0:
                return record
            self.retries += 1
        raise AssertionError("unreachable")
