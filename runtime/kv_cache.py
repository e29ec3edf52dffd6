"""KV caches: one key and one value buffer per layer, kept on the device (on every replica
under tensor parallelism, each with its share of the KV heads).

Programs update them in place (the cache parameter is aliased to an output), so after each
call the caller swaps in the returned buffers; the old ones are donated.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pyhlo.dtypes import byte_size, numpy_dtype


class KVCache:
    """`dtype`: the keys' and values' type; `stored_dtype`: the buffers' (u16 holding the bits of
    bf16 or f16 values; as_values reads them back)."""

    def __init__(self, placement: Any, n_layers: int, dims: tuple[int, ...], stored_dtype: str,
                 dtype: str | None = None):
        self.dims = tuple(dims)          # one device's cache
        self.stored_dtype = stored_dtype
        self.dtype = dtype or stored_dtype
        self.replicas = placement.replicas
        zeros = np.zeros(self.dims, dtype=numpy_dtype(stored_dtype))
        # Zeros, not garbage: masked slots get weight 0, and 0 * NaN would still be NaN.
        self.keys = [placement.put(zeros) for _ in range(n_layers)]
        self.values = [placement.put(zeros) for _ in range(n_layers)]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def byte_size(self) -> int:
        """Bytes over every layer and replica."""
        return 2 * self.n_layers * self.replicas * int(np.prod(self.dims)) * byte_size(self.stored_dtype)

    def as_values(self, stored: np.ndarray) -> np.ndarray:
        """A cache buffer read to the host (np.asarray), as the keys or values it holds."""
        if self.stored_dtype == self.dtype:
            return stored
        return np.asarray(stored).view(numpy_dtype(self.dtype))
