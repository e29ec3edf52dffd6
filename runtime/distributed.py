"""Several processes (on one machine or several) running one tensor-parallel model.

    from runtime import distributed
    distributed.initialize("10.0.0.1:4711", num_processes=2, process_id=0, local_device_count=2)
    model = LlamaForSampling.from_pretrained(path, tp_degree=4).to_neuron()   # replicas 0 and 1 here
    tokens = model.sample(input_ids, sequence_length=64, top_k=1)             # the same in every process

The processes meet through jax's distributed runtime (the PJRT coordination service that
jax.distributed uses: a coordinator address, a process count, a process id); collectives
between CPU devices of different processes go over gloo (TCP). Replica r of a program with
several replicas runs on the r-th device counted process by process, so process p of
processes with d devices each holds replicas p*d .. p*d + d - 1; each process reads the
checkpoint, but keeps and runs only its own replicas' parts. Every process must make the same
calls (build the same model, sample the same prompts) in the same order.

Without a call to initialize(), the first backend reads the same settings from the environment,
so that an unchanged script runs in several processes:

    PYHLO_COORDINATOR     host:port where process 0 serves the coordinator (reachable by all)
    PYHLO_NUM_PROCESSES   how many processes take part
    PYHLO_PROCESS_ID      this process's id, 0 .. PYHLO_NUM_PROCESSES - 1
    PYHLO_LOCAL_DEVICES   optional: CPU devices in this process (like
                          XLA_FLAGS=--xla_force_host_platform_device_count)
"""
from __future__ import annotations

import itertools
import os

ENVIRONMENT = ("PYHLO_COORDINATOR", "PYHLO_NUM_PROCESSES", "PYHLO_PROCESS_ID", "PYHLO_LOCAL_DEVICES")
_draws = itertools.count()


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_count: int | None = None, timeout_s: int = 300) -> None:
    """Join the processes of one run; call it before the first model or backend is built.

    coordinator_address: "host:port"; process 0 serves the coordinator there, the others
    connect to it (waiting up to timeout_s seconds for everyone to arrive).
    local_device_count: CPU devices of this process (default: XLA_FLAGS's, else one).
    """
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be an int in 0..{num_processes - 1}, got {process_id!r}")
    if local_device_count is not None and (not isinstance(local_device_count, int) or local_device_count < 1):
        raise ValueError(f"local_device_count must be an int >= 1, got {local_device_count!r}")
    from runtime import pjrt

    if pjrt.distributed_started():
        raise RuntimeError("the distributed runtime has already started in this process")
    pjrt.start_distributed(coordinator_address, num_processes, process_id, local_device_count, timeout_s)


def _int_setting(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def initialize_from_environment() -> bool:
    """initialize() with PYHLO_COORDINATOR, PYHLO_NUM_PROCESSES, PYHLO_PROCESS_ID and
    PYHLO_LOCAL_DEVICES when PYHLO_COORDINATOR is set and nothing has started yet; returns
    whether this process now takes part in a distributed run."""
    if not os.environ.get("PYHLO_COORDINATOR"):
        return is_initialized()
    if is_initialized():
        return True
    missing = [name for name in ENVIRONMENT[1:3] if not os.environ.get(name)]
    if missing:
        raise ValueError(f"PYHLO_COORDINATOR is set, but {' and '.join(missing)} are not: a distributed run "
                         "needs the coordinator's address, the process count and this process's id")
    devices = _int_setting("PYHLO_LOCAL_DEVICES") if os.environ.get("PYHLO_LOCAL_DEVICES") else None
    initialize(os.environ["PYHLO_COORDINATOR"], _int_setting("PYHLO_NUM_PROCESSES"),
               _int_setting("PYHLO_PROCESS_ID"), devices)
    return True


def is_initialized() -> bool:
    """True once this process has joined a distributed run."""
    from runtime import pjrt

    return pjrt.distributed_started()


def shutdown() -> None:
    """Leave the run: waits until every process leaves (done at exit otherwise)."""
    from runtime import pjrt

    pjrt.stop_distributed()


def agreed_entropy(timeout_s: float = 300) -> int:
    """64 random bits, the same in every process of the run (in one process: fresh ones).

    For what every replica must draw alike, such as an unseeded sampler's random state:
    process 0 draws and publishes, the others wait for it. Processes make the same calls in
    the same order, so their n-th calls meet.
    """
    key = f"pyhlo/entropy/{next(_draws)}"
    if not is_initialized():
        return int.from_bytes(os.urandom(8), "little")
    from runtime import pjrt

    if pjrt.distributed_process_index() == 0:
        value = os.urandom(8)
        pjrt.publish(key, value)
    else:
        value = pjrt.wait_for(key, timeout_s)
    return int.from_bytes(value, "little")
