"""What `pyhlo bench --device` needs to know about the device: is it there for both torch and
jax, what is it called, and how fast does it copy memory.

Nothing here touches jax in this process: a jax client on a GPU takes most of the GPU's
memory for itself, which the benchmark's workers need. jax's devices are looked up in a
short child process instead.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

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
               PYTHONPATH=os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
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
        raise DeviceMissing("--device cuda needs an NVIDIA GPU that both torch (the HF engines) and jax (pyhlo) "
                            "can use; nothing falls back to the CPU. Missing here:\n  - " + "\n  - ".join(problems))


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    from tools.bench import machine_info

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
    """The device's memory bandwidth: a GPU's copy rate, or the CPU's read rate (tools.bench's probes)."""
    if device == "cuda":
        return cuda_copy_bandwidth()
    from tools.bench import measure_bandwidth

    return measure_bandwidth(cpu_array_mb, threads)
