"""KV caches: one key and one value buffer per layer, kept on the device.

Programs update them in place (the cache parameter is aliased to an output), so
after each call the caller swaps in the returned buffers; the old ones are donated.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pyhlo.dtypes import byte_size, numpy_dtype


class KVCache:
    def __init__(self, backend: Any, n_layers: int, dims: tuple[int, ...], dtype: str):
        self.backend = backend
        self.dims = tuple(dims)
        self.dtype = dtype
        zeros = np.zeros(self.dims, dtype=numpy_dtype(dtype))
        # Zeros, not garbage: masked slots get weight 0, and 0 * NaN would still be NaN.
        self.keys = [backend.to_device(zeros) for _ in range(n_layers)]
        self.values = [backend.to_device(zeros) for _ in range(n_layers)]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def byte_size(self) -> int:
        return 2 * self.n_layers * int(np.prod(self.dims)) * byte_size(self.dtype)
