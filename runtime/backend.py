"""The backend interface: compile HloModuleProto bytes, move arrays, run executables.

    backend = get_backend()                       # runtime.select; env PYHLO_BACKEND / PYHLO_PLATFORM
    exe = backend.compile(proto.SerializeToString())
    outputs = exe.run({"x": x, "cache": cache})   # named inputs; aliased caches are donated
    result = backend.to_host(outputs[0])

No model knowledge lives here; parameter names and aliases come from the module itself.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import os
from typing import Any, Mapping, Sequence

import numpy as np

from pyhlo import dtypes
from pyhlo.schema import hlo_pb2

PLATFORMS = ("cpu", "cuda", "neuron")


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    name: str
    dtype: str  # element type name, e.g. "f32"
    dims: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    """What the runtime needs to know about a module: its parameters and aliases."""

    name: str
    parameters: tuple[ParameterSpec, ...]
    aliases: dict[int, tuple[int, ...]]  # parameter number -> output shape index

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)

    @classmethod
    def from_bytes(cls, hlo_bytes: bytes) -> ProgramInfo:
        module = hlo_pb2.HloModuleProto.FromString(hlo_bytes)
        shape = module.host_program_shape
        names = list(shape.parameter_names)
        if len(names) != len(shape.parameters) or len(set(names)) != len(names):
            names = [f"p{i}" for i in range(len(shape.parameters))]
        parameters = []
        for name, proto in zip(names, shape.parameters):
            dtype = dtypes.NAME_OF_PRIMITIVE.get(proto.element_type, f"type{proto.element_type}")
            parameters.append(ParameterSpec(name, dtype, tuple(proto.dimensions)))
        aliases = {e.parameter_number: tuple(e.output_shape_index) for e in module.input_output_alias.entries}
        return cls(module.name, tuple(parameters), aliases)


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        # Reinterpret the bits: a float round trip would not be exact for NaN payloads.
        return tensor.view(torch.int16).numpy().view(dtypes.numpy_dtype("bf16"))
    return tensor.numpy()


def _is_torch_tensor(value: Any) -> bool:
    # Checked by module name so that torch is imported only when a tensor shows up.
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def as_numpy(value: Any) -> np.ndarray:
    """A numpy array of a numpy array, torch tensor (bf16 included) or Python number/list."""
    if _is_torch_tensor(value):
        return _torch_to_numpy(value)
    return np.asarray(value)


class Executable:
    """A compiled program on its devices. Run it with inputs by position or by name."""

    def __init__(self, backend: XlaBackend, compiled: Any, info: ProgramInfo, num_replicas: int):
        from runtime import pjrt

        self._pjrt = pjrt
        self.backend = backend
        self.compiled = compiled
        self.info = info
        self.num_replicas = num_replicas
        self.serialized: bytes | None = None
        self._output_wrapping = pjrt.OutputWrapping()
        # Every replica's device (several processes: some are other processes'), and the
        # replicas this process runs; `devices` are those replicas' devices.
        self.replica_devices = backend.replica_devices(num_replicas)
        self.local_replicas = backend.local_replicas(num_replicas)
        self.devices = [self.replica_devices[r] for r in self.local_replicas]
        self._numpy_dtypes = [
            dtypes.numpy_dtype(p.dtype) if p.dtype in dtypes.ELEMENT_TYPES else None for p in info.parameters
        ]

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return self.info.parameter_names

    @property
    def donated_parameters(self) -> tuple[str, ...]:
        """Names of the parameters aliased to outputs: their input buffers are consumed by run()."""
        return tuple(self.info.parameters[n].name for n in sorted(self.info.aliases))

    def _ordered(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        names = self.info.parameter_names
        if isinstance(inputs, Mapping):
            missing = [n for n in names if n not in inputs]
            unknown = [n for n in inputs if n not in names]
            if missing or unknown:
                problems = []
                if missing:
                    problems.append(f"missing {', '.join(map(repr, missing))}")
                if unknown:
                    problems.append(f"unknown {', '.join(map(repr, unknown))}")
                raise ValueError(
                    f"{self.info.name}: {'; '.join(problems)}; expected inputs: {', '.join(names)}"
                )
            return [inputs[n] for n in names]
        inputs = list(inputs)
        if len(inputs) != len(names):
            raise ValueError(
                f"{self.info.name}: got {len(inputs)} inputs, expected {len(names)}: {', '.join(names)}"
            )
        return inputs

    def _to_buffers(self, values: list[Any], device: Any) -> list[Any]:
        buffers = []
        for spec, np_dtype, value in zip(self.info.parameters, self._numpy_dtypes, values):
            if not self._pjrt.is_buffer(value):
                array = as_numpy(value)
                if not isinstance(value, np.ndarray) and not _is_torch_tensor(value) and np_dtype is not None:
                    array = array.astype(np_dtype)  # Python numbers and lists take the parameter's type
                value = self._pjrt.to_device(array, device)
            # PJRT checks only byte sizes, so f32[8,4] would pass for f32[4,8]: check here.
            if value.shape != spec.dims or (np_dtype is not None and value.dtype != np_dtype):
                raise ValueError(
                    f"{self.info.name}: input {spec.name!r} is {value.dtype}{list(value.shape)}, "
                    f"expected {spec}"
                )
            buffers.append(value)
        return buffers

    def run(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        """Run on one device. Inputs: a list by parameter number or a dict by parameter name;
        each a numpy array, torch tensor or device buffer. Returns the outputs as device
        buffers (a tuple result flattened into a list). Buffers of aliased parameters are donated.
        """
        if self.num_replicas != 1:
            raise ValueError(f"{self.info.name} has {self.num_replicas} replicas: use run_replicated()")
        buffers = self._to_buffers(self._ordered(inputs), self.devices[0])
        return self._pjrt.execute(self.compiled, buffers, self._output_wrapping)

    def run_buffers(self, buffers: list[Any]) -> list[Any]:
        """run() without conversion or checks: device buffers in parameter order, one device.

        For hot loops whose arguments were produced by run() or to_device() and checked once.
        """
        return self._pjrt.execute(self.compiled, buffers, self._output_wrapping)

    def run_replicated(self, per_replica_inputs: Sequence[Sequence[Any] | Mapping[str, Any] | None]
                       ) -> list[list[Any] | None]:
        """Run every replica; per_replica_inputs[r] are replica r's inputs (list or dict).

        Returns outputs[r], the list of replica r's output buffers. Several processes: each runs
        its own replicas (local_replicas) together with the others; the inputs of other
        processes' replicas are not read (None will do) and their outputs are None.
        """
        if len(per_replica_inputs) != self.num_replicas:
            raise ValueError(
                f"{self.info.name}: got inputs for {len(per_replica_inputs)} replicas, "
                f"expected {self.num_replicas}"
            )
        per_device = []
        for replica, device in zip(self.local_replicas, self.devices):
            buffers = self._to_buffers(self._ordered(per_replica_inputs[replica]), device)
            for spec, buffer in zip(self.info.parameters, buffers):
                if self._pjrt.buffer_device(buffer) != device:
                    raise ValueError(
                        f"{self.info.name}: input {spec.name!r} of replica {replica} is on "
                        f"{self._pjrt.buffer_device(buffer)}, expected {device} "
                        f"(use backend.to_device(array, replica={replica}))"
                    )
            per_device.append(buffers)
        # XLA:CPU runs replicas on a shared thread pool; hundreds of replicated launches
        # in flight can deadlock at a collective's rendezvous, so cpu waits for each launch.
        wait = self.backend.platform == "cpu"
        local = self._pjrt.execute_sharded(self.compiled, per_device, wait=wait,
                                           replica_devices=self.replica_devices)
        if len(local) == self.num_replicas:
            return local
        outputs: list[list[Any] | None] = [None] * self.num_replicas
        for replica, out in zip(self.local_replicas, local):
            outputs[replica] = out
        return outputs

    def serialize(self) -> bytes:
        """The compiled executable as bytes; reload with backend.deserialize()."""
        if self.serialized is not None:
            return self.serialized
        return self._pjrt.serialize_executable(self.compiled)

    def hlo_text(self) -> str:
        """HLO text of the compiled (optimized) module."""
        return self._pjrt.compiled_hlo_text(self.compiled)

    def __repr__(self) -> str:
        params = ", ".join(map(str, self.info.parameters))
        return f"<Executable {self.info.name}({params}) on {self.backend.platform} x{self.num_replicas}>"


class Backend(abc.ABC):
    """Compiles HloModuleProto bytes into something runnable and moves arrays to and from it."""

    name: str
    platform: str

    @abc.abstractmethod
    def compile(self, hlo_bytes: bytes, num_replicas: int = 1) -> Any:
        """Compile serialized HloModuleProto bytes."""

    @abc.abstractmethod
    def deserialize(self, data: bytes, hlo_bytes: bytes, num_replicas: int = 1) -> Any:
        """Reload what `compile(hlo_bytes, num_replicas).serialize()` returned."""

    @abc.abstractmethod
    def to_device(self, array: Any, replica: int | None = None) -> Any:
        """Place a numpy array or torch tensor on the device of `replica` (None: the device
        one-replica programs run on)."""

    @abc.abstractmethod
    def to_host(self, buffer: Any) -> np.ndarray:
        """Copy a device buffer into a numpy array."""

    def host_address(self, buffer: Any) -> int | None:
        """The host address of a buffer's memory where the device uses host memory (XLA:CPU);
        None elsewhere."""
        return None

    @abc.abstractmethod
    def cache_key_parts(self) -> dict[str, str]:
        """Everything besides the HLO bytes that decides what compile() produces."""


@functools.lru_cache(maxsize=1)
def _host_cpu_fingerprint() -> str:
    # An XLA:CPU executable is built for this CPU's instruction set; a cache shared
    # between different machines must not hand one machine's code to another.
    import platform

    features = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    features += line
                    break
    except OSError:
        features += platform.processor()
    return hashlib.sha256(features.encode()).hexdigest()[:16]


class XlaBackend(Backend):
    """XLA through PJRT (jaxlib): platform cpu, cuda, or neuron with AWS's libneuronxla plugin."""

    name = "xla"

    def __init__(self, platform: str | None = None):
        from runtime import distributed, pjrt

        self._pjrt = pjrt
        # PYHLO_COORDINATOR & co. must take effect before the first backend starts.
        distributed.initialize_from_environment()
        self.platform = platform or detect_platform()
        if self.platform not in PLATFORMS:
            raise ValueError(f"unknown platform {self.platform!r}; valid platforms: {', '.join(PLATFORMS)}")
        # Every process's devices (replica r of a replicated program runs on devices[r]),
        # and this process's own.
        self.devices = pjrt.devices(self.platform)
        self.local_devices = [d for d in self.devices if pjrt.is_local(d)]
        self._local = set(self.local_devices)
        self._layout = pjrt.process_layout(self.platform)

    @property
    def device_count(self) -> int:
        """Devices over every process: how many replicas a program can have."""
        return len(self.devices)

    @property
    def process_index(self) -> int:
        """This process's index in a distributed run (runtime.distributed); 0 otherwise."""
        return self.local_devices[0].process_index

    @property
    def process_count(self) -> int:
        return len(self._layout)

    @property
    def parallel_compiles_safe(self) -> bool:
        """Whether programs may compile in several threads at once on this platform."""
        return self._pjrt.parallel_compiles_safe(self.platform)

    def replica_devices(self, num_replicas: int) -> list[Any]:
        """The device of each replica of a `num_replicas` program (some may be other processes')."""
        return self._pjrt.replica_devices(self.platform, num_replicas)

    def local_replicas(self, num_replicas: int) -> list[int]:
        """The replicas of a `num_replicas` program this process holds and runs (all in one process)."""
        return [r for r, d in enumerate(self.replica_devices(num_replicas)) if self._pjrt.is_local(d)]

    def _register_kernels_for(self, data: bytes) -> None:
        """pyhlo's CPU kernels must be registered before XLA builds a program calling them."""
        if self.platform != "cpu":
            return
        from runtime import cpu_kernels

        if cpu_kernels.referenced_by(data) and not cpu_kernels.register():
            raise RuntimeError("this program calls pyhlo's CPU kernels, but they are "
                               "off (PYHLO_CPU_KERNELS=0, or no C++ compiler): rebuild it with "
                               "NeuronConfig(cpu_kernels=False)")

    def compile(self, hlo_bytes: bytes, num_replicas: int = 1) -> Executable:
        info = ProgramInfo.from_bytes(hlo_bytes)
        self._register_kernels_for(hlo_bytes)
        compiled = self._pjrt.compile(hlo_bytes, self.platform, num_replicas=num_replicas)
        return Executable(self, compiled, info, num_replicas)

    def deserialize(self, data: bytes, hlo_bytes: bytes, num_replicas: int = 1) -> Executable:
        info = ProgramInfo.from_bytes(hlo_bytes)
        self._register_kernels_for(hlo_bytes)
        compiled = self._pjrt.deserialize_executable(self.platform, data, num_replicas=num_replicas)
        executable = Executable(self, compiled, info, num_replicas)
        # XLA:CPU cannot serialize a deserialized executable again (its code is not kept):
        # remember the bytes it came from.
        executable.serialized = data
        return executable

    def _device(self, replica: int | None) -> Any:
        if replica is None:
            return self.local_devices[0]
        if not 0 <= replica < len(self.devices):
            raise ValueError(f"replica {replica} out of range: {self.platform} has {len(self.devices)} "
                             "devices")
        device = self.devices[replica]
        if device not in self._local:
            mine = [r for r, d in enumerate(self.devices) if d in self._local]
            raise ValueError(
                f"replica {replica} runs on {device} of process {device.process_index}; this is process "
                f"{self.process_index}, which holds replicas {mine}: place it from its own process")
        return device

    def to_device(self, array: Any, replica: int | None = None) -> Any:
        device = self._device(replica)
        if self._pjrt.is_buffer(array):
            if self._pjrt.buffer_device(array) == device:
                return array
            array = self._pjrt.to_host(array)
        return self._pjrt.to_device(as_numpy(array), device)

    def to_host(self, buffer: Any) -> np.ndarray:
        return self._pjrt.to_host(buffer)

    def host_address(self, buffer: Any) -> int | None:
        return self._pjrt.host_address(buffer)

    def start_host_copy(self, buffer: Any) -> None:
        """Copy the buffer to the host as soon as it is computed, without waiting for it."""
        self._pjrt.start_host_copy(buffer)

    def compiler_version(self) -> str:
        return self._pjrt.compiler_version(self.platform)

    def cache_key_parts(self) -> dict[str, str]:
        parts = {
            "backend": self.name,
            "platform": self.platform,
            "compiler_version": self.compiler_version(),
            "flags": os.environ.get("XLA_FLAGS", ""),
            "options": repr(self._pjrt.compile_overrides(self.platform)),
        }
        if self.platform == "cpu":
            parts["host_cpu"] = _host_cpu_fingerprint()
        if self.process_count > 1:
            # Replicated programs are built for devices across processes (and run with
            # collectives between them): never confuse them with one process's.
            parts["processes"] = " | ".join(",".join(map(str, ids)) for ids in self._layout)
        return parts

    def hlo_text(self, hlo_bytes: bytes) -> str:
        """XLA's HLO text of module bytes (before optimization)."""
        return self._pjrt.hlo_text(hlo_bytes)

    def cost_analysis(self, hlo_bytes: bytes) -> dict[str, float | str]:
        """XLA's estimate of flops and bytes accessed for module bytes, with 'analysed by': whose
        estimate it is (XLA:CPU's where this platform's client has no cost analysis)."""
        return self._pjrt.cost_analysis(hlo_bytes, self.platform)

    def __repr__(self) -> str:
        where = f", process {self.process_index} of {self.process_count}" if self.process_count > 1 else ""
        return f"<XlaBackend {self.platform} x{len(self.devices)}{where}>"


def detect_platform() -> str:
    """neuron if AWS's PJRT plugin is present, else cuda if present, else cpu."""
    from runtime import pjrt

    available = pjrt.available_platforms()
    for platform in ("neuron", "cuda"):
        if platform in available:
            return platform
    return "cpu"

