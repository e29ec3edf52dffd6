"""Which backend: by argument, by env PYHLO_BACKEND / PYHLO_PLATFORM, or detected.

    backend = get_backend()                        # xla on the best platform present
    backend = get_backend("xla", platform="cpu")
    backend = get_backend("neuronx-cc")            # compiles NEFFs, runs nothing

This module knows every backend class; the backends themselves do not know each other.
"""
from __future__ import annotations

import os

from runtime.backend import PLATFORMS, Backend, XlaBackend
from runtime.neuronx_cc import NeuronCCBackend

BACKENDS = ("xla", "neuronx-cc")


def get_backend(name: str | None = None, platform: str | None = None) -> Backend:
    """The backend `name` (xla | neuronx-cc) on `platform` (cpu | cuda | neuron).

    Unset arguments come from env PYHLO_BACKEND and PYHLO_PLATFORM, else xla on the
    best platform present (neuron, then cuda, then cpu).
    """
    name = name or os.environ.get("PYHLO_BACKEND") or "xla"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    if name == "neuronx-cc":
        if platform not in (None, "neuron"):
            raise ValueError(f"the neuronx-cc backend compiles for platform 'neuron', not {platform!r}")
        return NeuronCCBackend()
    platform = platform or os.environ.get("PYHLO_PLATFORM") or None
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; valid platforms: {', '.join(PLATFORMS)}")
    return XlaBackend(platform)
