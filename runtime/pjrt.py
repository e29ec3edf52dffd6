"""XLA through PJRT, as shipped in jaxlib: the one module that touches private jaxlib APIs.

Everything here takes or returns plain values (HloModuleProto bytes, numpy arrays,
device buffers, executables), so the rest of the project never imports jaxlib
internals. The private names used below were checked against jaxlib 0.10.2.
"""
from __future__ import annotations

import atexit
import functools
import threading
import warnings
from typing import Any, Sequence

import jax
import jaxlib
import numpy as np
from jax._src.lib import _jax
from jax._src.lib import xla_client as xc

PINNED_JAXLIB = "0.10.2"
PLATFORMS = ("cpu", "cuda", "neuron")

if jaxlib.__version__ != PINNED_JAXLIB:
    warnings.warn(
        f"runtime.pjrt was written against jaxlib=={PINNED_JAXLIB} private APIs "
        f"(jax._src.lib.xla_client and _jax), but jaxlib {jaxlib.__version__} is installed; "
        f"install jax=={PINNED_JAXLIB} jaxlib=={PINNED_JAXLIB} if compiling or running fails.",
        RuntimeWarning,
        stacklevel=2,
    )

_INSTALL_HINTS = {
    "cuda": "install jax's CUDA plugin on a machine with an NVIDIA GPU: pip install -e '.[cuda]' in pyhlo's "
            "checkout (jax[cuda13]=={v}; '.[cuda12]' for drivers older than CUDA 13)",
    "neuron": "install AWS's PJRT plugin libneuronxla (from the AWS Neuron SDK's own package index) "
              "on a Neuron (trn/inf) host",
    "cpu": "reinstall jaxlib=={v}",
}

Buffer = Any  # a jax Array holding one device buffer
LoadedExecutable = Any


def _devices(platform: str) -> list:
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; valid platforms: {', '.join(PLATFORMS)}")
    try:
        return list(jax.devices(platform))
    except RuntimeError as err:
        hint = _INSTALL_HINTS[platform].format(v=PINNED_JAXLIB)
        raise RuntimeError(f"no {platform!r} PJRT devices ({err}); {hint}") from None


def devices(platform: str = "cpu") -> list:
    """The platform's devices in every process, ordered by process, then id (replica r of a
    several-replica program runs on devices(platform)[r])."""
    return sorted(_devices(platform), key=lambda d: (d.process_index, d.id))


def is_local(device: Any) -> bool:
    """True for a device of this process (one whose buffers this process can hold)."""
    return device.process_index == device.client.process_index()


def local_devices(platform: str = "cpu") -> list:
    """This process's devices of the platform, ordered by id (all of them in one process)."""
    return [d for d in devices(platform) if is_local(d)]


def process_layout(platform: str = "cpu") -> list[list[int]]:
    """The device ids of each process, process by process: [[0, 1], [2048, 2049]] for two
    processes with two CPU devices each; one list in a single process."""
    layout: dict[int, list[int]] = {}
    for device in devices(platform):
        layout.setdefault(device.process_index, []).append(device.id)
    return [layout[p] for p in sorted(layout)]


def start_distributed(coordinator_address: str, num_processes: int, process_id: int,
                      cpu_device_count: int | None = None, timeout_s: int = 300) -> None:
    """Join jax's distributed runtime (process 0 also serves as coordinator), with gloo over
    TCP for collectives between CPU devices of different processes. Must run before any
    backend starts: the CPU client is created knowing the other processes."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("the distributed runtime must start before the first backend: call "
                           "runtime.distributed.initialize() before building any model or backend")
    # Cross-process collectives on CPU; without them a program's all-reduce would
    # only ever see this process's replicas.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cpu_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_device_count))
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)
    # Leave together: shutdown waits for every process, so that the coordinator (process 0)
    # does not go away while another process still runs collectives.
    atexit.register(jax.distributed.shutdown)


def distributed_started() -> bool:
    """True once start_distributed() (or jax.distributed.initialize) has run in this process."""
    return jax.distributed.is_initialized()


def distributed_process_index() -> int:
    """This process's id in the distributed run (0 outside one)."""
    return jax.process_index()


def stop_distributed() -> None:
    """Leave the distributed runtime (waits for the other processes)."""
    jax.distributed.shutdown()


def _coordination_client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("no distributed run: call runtime.distributed.initialize() first")
    return client


def publish(key: str, value: bytes) -> None:
    """Store `value` under `key` in the run's coordination service, for every process to read."""
    _coordination_client().key_value_set_bytes(key, value)


def wait_for(key: str, timeout_s: float) -> bytes:
    """The value some process published under `key`, waiting up to timeout_s seconds for it."""
    return _coordination_client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))


def get_client(platform: str = "cpu") -> Any:
    """The PJRT client of `platform` (cpu, cuda or neuron)."""
    return _devices(platform)[0].client


def available_platforms() -> list[str]:
    """The platforms among cpu, cuda and neuron that have devices in this process."""
    found = []
    for platform in PLATFORMS:
        try:
            jax.devices(platform)
        except RuntimeError:
            continue
        found.append(platform)
    return found


def compile_overrides(platform: str) -> tuple[tuple[str, Any], ...]:
    """XLA options pyhlo sets beside the defaults, by platform. Off XLA:CPU,
    xla_allow_excess_precision=false: every convert in a program rounds as written (XLA:GPU
    otherwise drops an f32 -> bf16 -> f32 pair and keeps bf16 values in f32 inside fusions,
    so a bf16 model would no longer round where HF's PyTorch model does)."""
    return () if platform == "cpu" else (("xla_allow_excess_precision", False),)


def parallel_compiles_safe(platform: str) -> bool:
    """Whether several compiles may run at once in one process: on XLA:CPU yes; with the CUDA
    plugin two threads in compile_and_load crashed the process (seen with jaxlib 0.11.2), so
    elsewhere programs compile one at a time."""
    return platform == "cpu"


def _compile_options(num_replicas: int, device_ids: Sequence[int], platform: str = "cpu") -> Any:
    options = xc.CompileOptions()
    overrides = compile_overrides(platform)
    if overrides:
        options.env_option_overrides = list(overrides)
    if num_replicas > 1:
        options.num_replicas = num_replicas
        # One computation (no SPMD partitions): row r is the device of replica r.
        options.device_assignment = xc.DeviceAssignment.create(
            np.array([[d] for d in device_ids], dtype=np.int32)
        )
    return options


def replica_devices(platform: str, num_replicas: int) -> list:
    """The device of each replica: a one-replica program runs on this process's first device
    (every process its own copy); replica r of a several-replica program on devices()[r],
    which may belong to another process."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if num_replicas == 1:
        return local_devices(platform)[:1]
    all_devices = devices(platform)
    if num_replicas > len(all_devices):
        hint = (" (on cpu, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "before the process starts jax)") if platform == "cpu" else ""
        processes = len(process_layout(platform))
        where = f" over {processes} processes" if processes > 1 else ""
        raise ValueError(
            f"{num_replicas} replicas need {num_replicas} {platform} devices, "
            f"found {len(all_devices)}{where}{hint}"
        )
    return all_devices[:num_replicas]


def _pick_devices(platform: str, num_replicas: int, device_ids: Sequence[int] | None) -> list:
    if device_ids is None:
        return replica_devices(platform, num_replicas)
    all_devices = devices(platform)
    by_id = {d.id: d for d in all_devices}
    device_ids = list(device_ids)
    if len(device_ids) != num_replicas:
        raise ValueError(f"device_ids {device_ids} must name one device per replica ({num_replicas})")
    unknown = [i for i in device_ids if i not in by_id]
    if unknown:
        raise ValueError(f"unknown {platform} device ids {unknown}; have {sorted(by_id)}")
    return [by_id[i] for i in device_ids]


_first_device_list = threading.Lock()
_device_list_iterated = False


def _device_list(chosen: list) -> Any:
    """xc.DeviceList over `chosen`. Two threads compiling at once in a fresh process failed once
    with "iter() returned non-iterator of type 'ifrt_device_iterator'" (jaxlib 0.10.2, a bench's
    parallel bucket compiles): the list's iterator, made on first use, seen half-made. So the
    first list of a process is iterated here, under a lock, before any reaches the compiler."""
    global _device_list_iterated
    device_list = xc.DeviceList(tuple(chosen))
    if not _device_list_iterated:
        with _first_device_list:
            list(device_list)
            _device_list_iterated = True
    return device_list


def compile(hlo_module_bytes: bytes, platform: str = "cpu", num_replicas: int = 1,
            device_ids: Sequence[int] | None = None) -> LoadedExecutable:
    """Compile serialized HloModuleProto bytes into an executable loaded on the devices."""
    chosen = _pick_devices(platform, num_replicas, device_ids)
    # HLO -> StableHLO bytecode directly: faster and leaner than printing MLIR text.
    stablehlo = _jax.mlir.hlo_to_stablehlo(hlo_module_bytes)
    options = _compile_options(num_replicas, [d.id for d in chosen], platform)
    # Every process compiles for all replicas' devices (its client knows the others'); at
    # run time it runs only its own.
    return get_client(platform).compile_and_load(stablehlo, _device_list(chosen), options)


def serialize_executable(exe: LoadedExecutable) -> bytes:
    """The executable as bytes (reload with deserialize_executable on the same platform)."""
    return exe.client.serialize_executable(exe)


def deserialize_executable(platform: str, data: bytes, num_replicas: int = 1,
                           device_ids: Sequence[int] | None = None) -> LoadedExecutable:
    """Load an executable written by serialize_executable onto the devices."""
    chosen = _pick_devices(platform, num_replicas, device_ids)
    options = _compile_options(num_replicas, [d.id for d in chosen], platform)
    return get_client(platform).deserialize_executable(data, _device_list(chosen), options)


class OutputWrapping:
    """How one executable's outputs become buffers, learned on its first run (each output's
    shape, type and device) so that later runs wrap them in C++: jax's disassembly of the
    results calls back into Python for each output, about 10 us apiece (a decode step of a
    30-layer model, 64 outputs with its KV caches: 670 -> 60 us)."""

    def __init__(self) -> None:
        self.handlers: list[Any] | None = None


def execute(exe: LoadedExecutable, args: Sequence[Buffer], wrapping: OutputWrapping | None = None
            ) -> list[Buffer]:
    """Run a one-device executable; a tuple result comes back flattened into a list.
    wrapping: the executable's own OutputWrapping, kept by the caller for its later runs."""
    results = exe.execute_sharded(list(args))
    if wrapping is not None and wrapping.handlers is not None:
        return results.consume_with_handlers(wrapping.handlers)
    outputs = [shards[0] for shards in results.disassemble_into_single_device_arrays()]
    if wrapping is not None:
        wrapping.handlers = [_jax.array_result_handler(jax.core.ShapedArray(out.shape, out.dtype),
                                                       out.sharding, True, _skip_checks=True)
                             for out in outputs]
    return outputs


@functools.lru_cache(maxsize=64)
def _replica_sharding(replica_devices: tuple) -> Any:
    mesh = jax.sharding.Mesh(np.array(replica_devices), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))


def _replicated_array(shards: Sequence[Buffer], sharding: Any, num_replicas: int) -> Buffer:
    # execute_sharded wants, per parameter, one array over every replica's device holding
    # this process's buffers (as jax's own multi-process calls pass them). Only the
    # per-device buffers are read, so the global aval is nominal (replicas stacked on a
    # new leading axis) and checks are skipped.
    first = shards[0]
    aval = jax.core.ShapedArray((num_replicas,) + tuple(first.shape), first.dtype)
    return _jax.ArrayImpl(aval, sharding, list(shards), True, True)


def execute_sharded(exe: LoadedExecutable, per_device_args: Sequence[Sequence[Buffer]],
                    wait: bool = False, replica_devices: Sequence[Any] | None = None) -> list[list[Buffer]]:
    """Run a replicated executable: per_device_args[i] are the arguments of this process's
    i-th replica (every replica in one process).

    replica_devices: every replica's device, this process's and the others' (default: this
    process's devices, which is all of them in one process). Returns outputs[i][j], output j
    of this process's i-th replica. With wait=True the call returns only when this process's
    replicas have finished.
    """
    n = len(per_device_args)
    arity = {len(a) for a in per_device_args}
    if len(arity) != 1:
        raise ValueError("every replica needs the same number of arguments, got "
                         f"{[len(a) for a in per_device_args]}")
    (num_args,) = arity
    everyone = tuple(replica_devices) if replica_devices is not None else tuple(exe.local_devices())
    sharding = _replica_sharding(everyone)
    grouped = [_replicated_array([per_device_args[r][i] for r in range(n)], sharding, len(everyone))
               for i in range(num_args)]
    per_output = exe.execute_sharded(grouped).disassemble_into_single_device_arrays()
    outputs = [[per_output[i][r] for i in range(len(per_output))] for r in range(n)]
    if wait:
        jax.block_until_ready(outputs)
    return outputs


def to_device(array: np.ndarray, device: Any) -> Buffer:
    """Copy a numpy array to `device` (64-bit types keep their width). XLA:CPU uses an array
    that starts at a 64-byte boundary in place instead, whatever may_alias says: such an array
    must not be written while the buffer lives."""
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    # jaxlib's own transfer, as jax.device_put ends in it, without jax's dispatch in Python
    # before it (a decode step's small inputs: 110 -> 14 us each); enable_x64 keeps s64/u64/f64
    # at 64 bits (jax's default narrows them to 32).
    return xc.batched_device_put(jax.core.ShapedArray(array.shape, array.dtype), _one_device_sharding(device),
                                 [array], [device], True, enable_x64=array.dtype.itemsize == 8)


@functools.cache
def _one_device_sharding(device: Any) -> Any:
    return jax.sharding.SingleDeviceSharding(device)


def host_address(buffer: Buffer) -> int | None:
    """Where an XLA:CPU buffer's memory lies in this process: a host array placed without a
    copy (64-byte aligned, see runtime/host_memory.py) is used in place, at its own address.
    None on other platforms (their buffers are in device memory)."""
    if buffer_device(buffer).platform != "cpu":
        return None
    return buffer.unsafe_buffer_pointer()


def to_host(buffer: Buffer) -> np.ndarray:
    """Copy a device buffer into a new numpy array.

    A copy, not a view: a live numpy view of a buffer stops XLA from donating
    that buffer to an aliased output (it silently copies instead).
    """
    return np.array(buffer, copy=True)


def start_host_copy(buffer: Buffer) -> None:
    """Start the device-to-host copy of `buffer` (done once it is computed); a later
    to_host() then needs no transfer of its own."""
    buffer.copy_to_host_async()


def is_buffer(value: Any) -> bool:
    """True for a device buffer (a jax Array)."""
    return isinstance(value, jax.Array)


def buffer_device(buffer: Buffer) -> Any:
    """The one device holding `buffer`."""
    (device,) = buffer.devices()
    return device


def block_until_ready(buffers: Any) -> Any:
    """Wait until the buffers (any nesting of lists) are computed."""
    return jax.block_until_ready(buffers)


def _hlo_module(proto_bytes: bytes) -> Any:
    return xc.hlo.HloModule.from_serialized_hlo_module_proto(proto_bytes)


def hlo_text(proto_bytes: bytes) -> str:
    """XLA's HLO text of a serialized HloModuleProto."""
    return _hlo_module(proto_bytes).to_string()


def hlo_dot_graph(proto_bytes: bytes) -> str:
    """A Graphviz dot graph of the module's entry computation."""
    return xc.hlo.hlo_module_to_dot_graph(_hlo_module(proto_bytes))


def client_cost_analysis(proto_bytes: bytes, platform: str) -> dict[str, float]:
    """The cost estimate of `platform`'s own PJRT client; raises where the client has none."""
    return dict(_jax.hlo_module_cost_analysis(get_client(platform), _hlo_module(proto_bytes)))


def cost_analysis(proto_bytes: bytes, platform: str = "cpu") -> dict[str, float | str]:
    """XLA's cost estimate of the unoptimized module: 'flops', 'bytes accessed', ..., and
    'analysed by', whose estimate it is ("XLA:cpu").

    A plugin reached through the PJRT C API (jax's CUDA plugin) has no cost analysis; the
    estimate is then XLA:CPU's of the same module (the CPU client is always there), and
    'analysed by' says so and why.
    """
    try:
        return {**client_cost_analysis(proto_bytes, platform), "analysed by": f"XLA:{platform}"}
    except RuntimeError as error:  # jaxlib's JaxRuntimeError, e.g. UNIMPLEMENTED
        if platform == "cpu":
            raise
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        source = f"XLA:cpu's, the {platform} client has none ({reason})"
        return {**client_cost_analysis(proto_bytes, "cpu"), "analysed by": source}


def compiled_hlo_text(exe: LoadedExecutable) -> str:
    """HLO text of the module as compiled (after XLA's optimization passes)."""
    return exe.hlo_modules()[0].to_string()


def compiler_version(platform: str = "cpu") -> str:
    """jaxlib's version and the PJRT platform's version string."""
    client = get_client(platform)
    return f"jaxlib {jaxlib.__version__}; {client.platform} {client.platform_version}"
