"""The memory a model's weights and KV caches take on its devices, from the declared
parameters and cache shapes alone (no weight read, nothing compiled), and the check that
refuses, before anything is built, a model the machine cannot hold.

    planned = planned_memory(builder)            # one replica's weights and KV caches
    check_fits(planned, replicas=2, backend=backend)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pyhlo import dtypes


@dataclass(frozen=True)
class PlannedMemory:
    """Bytes on one replica: weights as placed (the program's layout, type and share) and
    the KV caches of every layer."""

    n_layers: int
    layer_weight_bytes: int          # one layer
    shared_weight_bytes: int         # embedding, final norm, LM head
    kv_cache_bytes: int              # keys and values of every layer

    @property
    def weight_bytes(self) -> int:
        return self.layer_weight_bytes * self.n_layers + self.shared_weight_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


class ModelTooLarge(MemoryError, ValueError):
    """A model the machine cannot hold: bad input (a ValueError, as the command line reports
    one), found before anything is built."""


def _spec_bytes(spec: Any) -> int:
    return math.prod(spec.dims) * dtypes.byte_size(spec.dtype)


def planned_memory(builder: Any) -> PlannedMemory:
    """What load_weights() and the KV caches will place on each replica (a ProgramBuilder's
    declared parameters and cache spec)."""
    n_layers = builder.decoder.n_layers
    cache = builder.cache_spec("cache")
    return PlannedMemory(
        n_layers=n_layers,
        layer_weight_bytes=sum(_spec_bytes(builder.spec(p)) for p in builder.layer_params()),
        shared_weight_bytes=sum(_spec_bytes(builder.spec(p)) for p in builder.shared_params()),
        kv_cache_bytes=2 * n_layers * _spec_bytes(cache))


def gib(n: float) -> str:
    """Bytes in GiB (MiB below one GiB)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _device_free_bytes(backend: Any) -> int | None:
    """The smallest free memory of the backend's local devices, where PJRT reports it."""
    free = []
    for device in getattr(backend, "local_devices", []):
        try:
            stats = device.memory_stats() or {}
        except Exception:       # a plugin without memory statistics: nothing to check against
            return None
        if stats.get("bytes_limit", 0) <= 0:      # not reported: nothing to check against
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free) if free else None


def check_fits(planned: PlannedMemory, replicas: int, backend: Any) -> None:
    """ModelTooLarge, in one line, when the `replicas` replicas this process holds need more
    than the machine has: on cpu every replica lives in this machine's RAM (psutil's available
    memory, which counts the page cache as free); on a GPU each replica in its device's free
    memory, where PJRT reports it."""
    layout = (f"weights {gib(planned.weight_bytes)} + KV caches {gib(planned.kv_cache_bytes)}"
              + (f" per replica x {replicas}" if replicas > 1 else ""))
    fix = "use a smaller batch_size or n_positions, a narrower amp, or a quantized form"
    if getattr(backend, "platform", "cpu") == "cpu":
        import psutil

        need = planned.total_bytes * replicas
        memory = psutil.virtual_memory()
        if need > memory.available:
            raise ModelTooLarge(f"this model needs {gib(need)} ({layout}); this machine has "
                              f"{gib(memory.available)} available of {gib(memory.total)} RAM: {fix}")
        return
    free = _device_free_bytes(backend)
    if free is not None and planned.total_bytes > free:
        raise ModelTooLarge(f"this model needs {gib(planned.total_bytes)} on each device ({layout}); "
                          f"the {backend.platform} device has {gib(free)} free: {fix}")
