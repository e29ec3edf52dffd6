"""Where values live: one device, or one buffer per replica of a tensor-parallel program.

    placement = Placement(backend, replicas=4)
    ids = placement.put(np.array(...))          # the same array on every replica: Replicas
    weight = placement.put_each(shards)         # shard r on replica r
    weight = placement.put_parts(lambda r: part_of(full, r))   # each part made only where it is kept
    placement.host(logits)                      # the first replica's copy, as numpy

With one replica, values are plain device buffers and nothing else changes. Across several
processes (runtime.distributed) each process holds only its own replicas (`local`): the
others' entries of a Replicas are None, and put/put_each/put_parts place this process's only.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from runtime import huge_pages


class Replicas(list):
    """One entry per replica, replica r's device buffer at [r]; None where another process
    holds that replica."""


def _asked(replicas: int) -> str:
    """The replica count as users set it: from_pretrained(tp_degree=...) or --tp-degree."""
    return f"tp_degree={replicas} (--tp-degree {replicas})"


def _too_few_devices(backend: Any, replicas: int, count: int) -> str:
    platform = getattr(backend, "platform", "?")
    processes = getattr(backend, "process_count", 1)
    where = f" over its {processes} processes" if processes > 1 else ""
    message = (f"{_asked(replicas)} needs {replicas} devices; the {platform} backend has {count}{where}: "
               f"pass a tp_degree of at most {count}")
    if platform == "cpu":
        message += (f", or give XLA:CPU {replicas} devices: XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={replicas} set before the process starts (the "
                    f"pyhlo commands set it for --tp-degree; across processes: PYHLO_LOCAL_DEVICES, or "
                    f"distributed.initialize(local_device_count=...))")
    return message


class Placement:
    def __init__(self, backend: Any, replicas: int = 1):
        count = getattr(backend, "device_count", 1)
        if replicas > count:
            raise ValueError(_too_few_devices(backend, replicas, count))
        self.backend = backend
        self.replicas = replicas
        # The replicas this process holds: all of them, except across several processes.
        local = getattr(backend, "local_replicas", None)
        self.local: list[int] = (list(local(replicas)) if local is not None and replicas > 1
                                 else list(range(replicas)))
        if not self.local:
            raise ValueError(
                f"{_asked(replicas)} runs on the first {replicas} of the {count} devices of "
                f"{backend.process_count} processes, none of them in this process ({backend.process_index}): "
                f"pass the same tp_degree in every process, large enough to reach each one's devices "
                f"(tp_degree={count}: every device)")
        self._is_local = [r in self.local for r in range(replicas)]

    def put(self, array: Any) -> Any:
        """`array` on the device, or on every replica (of this process)."""
        return self.put_parts(lambda r: array)

    def put_each(self, arrays: Sequence[Any]) -> Any:
        """arrays[r] on replica r (one replica: arrays[0] on the device); other processes'
        entries are not read."""
        return self.put_parts(lambda r: arrays[r])

    def put_parts(self, part: Callable[[int], Any], streamed: bool = False) -> Any:
        """part(r) on replica r, made and placed one replica at a time, for this process's
        replicas only: no process makes the parts it does not keep. `streamed`: a value the
        programs read whole at every step (a weight), kept on 2 MB pages on CPUs
        (runtime/huge_pages.py)."""
        if self.replicas == 1:
            return self._placed(self.backend.to_device(part(0)), streamed)
        return Replicas(self._placed(self.backend.to_device(part(r), replica=r), streamed) if mine else None
                        for r, mine in enumerate(self._is_local))

    def host_addresses(self, value: Any) -> set[int]:
        """Where this process's buffers of a value lie in host memory, for those the device
        keeps there (XLA:CPU): a host array placed without a copy is at its own address."""
        address = getattr(self.backend, "host_address", None)
        if address is None:
            return set()
        buffers = [b for b in value if b is not None] if isinstance(value, Replicas) else [value]
        return {address(b) for b in buffers} - {None}

    def _placed(self, buffer: Any, streamed: bool) -> Any:
        if streamed and getattr(self.backend, "platform", None) == "cpu":
            huge_pages.collapse(buffer)
        return buffer

    def start_host_copy(self, value: Any) -> None:
        """Begin copying a value (this process's first replica's buffer) to the host once it
        is computed, so that host() later finds it there instead of waiting for the copy."""
        buffer = value[self.local[0]] if isinstance(value, Replicas) else value
        start = getattr(self.backend, "start_host_copy", None)
        if start is not None:
            start(buffer)

    def host(self, value: Any, replica: int | None = None) -> np.ndarray:
        """Replica `replica`'s buffer of a value on the host (None: this process's first
        replica, for values every replica holds alike; with one replica: the value's)."""
        if not isinstance(value, Replicas):
            return self.backend.to_host(value)
        if replica is None:
            replica = self.local[0]
        if not 0 <= replica < len(value):
            raise ValueError(f"replica {replica} out of range: the value has {len(value)} replicas")
        if value[replica] is None:
            raise ValueError(
                f"replica {replica} is held by another process: process {self.backend.process_index} "
                f"holds replicas {self.local} (read the others in their own processes)")
        return self.backend.to_host(value[replica])
