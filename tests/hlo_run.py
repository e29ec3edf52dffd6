"""Compile a PyHLO module with the default backend and run it on numpy inputs."""
from __future__ import annotations

import numpy as np


def run_module(proto, *args: np.ndarray) -> list[np.ndarray]:
    from runtime.select import get_backend

    backend = get_backend()
    executable = backend.compile(proto.SerializeToString())
    return [backend.to_host(out) for out in executable.run(list(args))]


def run_fn(fn, *args: np.ndarray) -> list[np.ndarray]:
    from pyhlo import compile_py_func

    return run_module(compile_py_func(fn), *args)
