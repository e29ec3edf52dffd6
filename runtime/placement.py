"""Where values live: one device, or one buffer per replica of a tensor-parallel program.

    placement = Placement(backend, replicas=4)
    ids = placement.put(np.array(...))          # the same array on every replica: Replicas
    weight = placement.put_each(shards)         # shard r on replica r
    placement.host(logits)                      # replica 0's copy, as numpy

With one replica, values are plain device buffers and nothing else changes.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class Replicas(list):
    """One device buffer per replica; replica r's at [r]."""


class Placement:
    def __init__(self, backend: Any, replicas: int = 1):
        count = getattr(backend, "device_count", 1)
        if replicas > count:
            raise ValueError(
                f"tp_degree {replicas} needs {replicas} devices; the {getattr(backend, 'platform', '?')} backend has "
                f"{count} (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={replicas} before the "
                "process starts)")
        self.backend = backend
        self.replicas = replicas

    def put(self, array: Any) -> Any:
        """`array` on the device, or on every replica."""
        if self.replicas == 1:
            return self.backend.to_device(array)
        return Replicas(self.backend.to_device(array, replica=r) for r in range(self.replicas))

    def put_each(self, arrays: Sequence[Any]) -> Any:
        """arrays[r] on replica r (one replica: arrays[0] on the device)."""
        if self.replicas == 1:
            return self.backend.to_device(arrays[0])
        return Replicas(self.backend.to_device(a, replica=r) for r, a in enumerate(arrays))

    def host(self, value: Any, replica: int = 0) -> np.ndarray:
        """Replica `replica`'s buffer of a value on the host (with one replica: the value's)."""
        return self.backend.to_host(value[replica] if isinstance(value, Replicas) else value)
