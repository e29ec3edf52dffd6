"""The neuronx-cc backend: AWS's Neuron compiler turns HloModuleProto files into NEFF files.

    backend = NeuronCCBackend(target="trn1")
    artifact = backend.compile(proto.SerializeToString())   # runs `neuronx-cc compile --framework XLA ...`
    artifact.neff_path, artifact.neff_bytes

This backend only compiles. Running a NEFF needs the Neuron runtime on a Neuron host;
to compile and run there through XLA use get_backend("xla", platform="neuron")
(AWS's libneuronxla PJRT plugin).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from typing import Any, Sequence

import numpy as np

from runtime.backend import Backend, ProgramInfo

TARGETS = ("trn1", "inf2", "trn2")
COMPILER = "neuronx-cc"


def neuronx_cc_command(pb_path: str, neff_path: str, target: str, flags: Sequence[str] = ()) -> list[str]:
    """The neuronx-cc command line that compiles the HloModuleProto file pb_path into neff_path.

    The backend and `pyhlo compile` both build their commands here. A replicated
    (tensor-parallel) program compiles with the same command: one NEFF, which the Neuron
    runtime loads on each of its NeuronCores.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown Neuron target {target!r}; valid targets: {', '.join(TARGETS)}")
    return [COMPILER, "compile", "--framework", "XLA", pb_path,
            "--target", target, "--output", neff_path, *flags]


def compiler_path() -> str | None:
    """Where `neuronx-cc` is on PATH, or None."""
    return shutil.which(COMPILER)


INSTALL_HINT = (
    "neuronx-cc is not on PATH: on a Neuron (trn/inf) host, install neuronx-cc from the AWS "
    "Neuron SDK's own package index (the PyPI package of that name is only a placeholder); "
    "or use get_backend('xla') to compile with XLA through PJRT"
)
_RUN_HINT = (
    "a NEFF runs only on the Neuron runtime of a Neuron host; this backend compiles only. "
    "To compile and run on NeuronCores use get_backend('xla', platform='neuron') with "
    "AWS's libneuronxla PJRT plugin installed"
)


class NeffArtifact:
    """A NEFF written by neuronx-cc: its bytes, its file and the command that built it."""

    def __init__(self, neff_bytes: bytes, neff_path: str, info: ProgramInfo, num_replicas: int = 1,
                 command: Sequence[str] = ()):
        self.neff_bytes = neff_bytes
        self.neff_path = neff_path
        self.info = info
        self.num_replicas = num_replicas
        self.command = list(command)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return self.info.parameter_names

    def serialize(self) -> bytes:
        return self.neff_bytes

    def run(self, inputs: Any) -> list[Any]:
        raise RuntimeError(f"cannot run {self.neff_path}: {_RUN_HINT}")

    def run_replicated(self, per_replica_inputs: Any) -> list[list[Any]]:
        raise RuntimeError(f"cannot run {self.neff_path}: {_RUN_HINT}")

    def __repr__(self) -> str:
        return f"<NeffArtifact {self.info.name} {self.neff_path} ({len(self.neff_bytes)} bytes)>"


class NeuronCCBackend(Backend):
    """Compiles with the `neuronx-cc` command (target from argument, env NEURON_TARGET, else trn1;
    extra flags from argument or env NEURON_CC_FLAGS). `cores`: the NeuronCores the programs
    are compiled for (a tensor-parallel model's replicas); the runtime of the Neuron host that
    loads the NEFFs provides them, this backend places nothing on them."""

    name = "neuronx-cc"
    platform = "neuron"

    def __init__(self, target: str | None = None, flags: Sequence[str] | str | None = None,
                 workdir: str | None = None, cores: int = 1):
        self.target = target or os.environ.get("NEURON_TARGET") or "trn1"
        if self.target not in TARGETS:
            raise ValueError(f"unknown Neuron target {self.target!r}; valid targets: {', '.join(TARGETS)}")
        if not isinstance(cores, int) or cores < 1:
            raise ValueError(f"cores must be an int >= 1, got {cores!r}")
        self.cores = cores
        if flags is None:
            flags = os.environ.get("NEURON_CC_FLAGS", "")
        self.flags = shlex.split(flags) if isinstance(flags, str) else list(flags)
        self._workdir = workdir
        self._version: str | None = None

    @property
    def device_count(self) -> int:
        """The NeuronCores the programs are compiled for (see `cores`)."""
        return self.cores

    @property
    def workdir(self) -> str:
        """Where the .pb inputs and .neff outputs go (a new temporary directory unless given)."""
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="pyhlo-neuronx-cc-")
        os.makedirs(self._workdir, exist_ok=True)
        return self._workdir

    def build_command(self, pb_path: str, neff_path: str) -> list[str]:
        """The neuronx-cc command line that compiles pb_path into neff_path."""
        return neuronx_cc_command(pb_path, neff_path, self.target, self.flags)

    def write_module(self, hlo_bytes: bytes) -> str:
        """Write the module to <workdir>/<sha256 prefix>.pb and return the path."""
        digest = hashlib.sha256(hlo_bytes).hexdigest()[:24]
        pb_path = os.path.join(self.workdir, f"{digest}.pb")
        with open(pb_path, "wb") as f:
            f.write(hlo_bytes)
        return pb_path

    def compile(self, hlo_bytes: bytes, num_replicas: int = 1) -> NeffArtifact:
        info = ProgramInfo.from_bytes(hlo_bytes)
        if compiler_path() is None:
            raise RuntimeError(INSTALL_HINT)
        pb_path = self.write_module(hlo_bytes)
        neff_path = pb_path[: -len(".pb")] + ".neff"
        command = self.build_command(pb_path, neff_path)
        # neuronx-cc writes logs and scratch files into its working directory.
        done = subprocess.run(command, cwd=self.workdir, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"neuronx-cc failed (exit {done.returncode}) on {pb_path}: {shlex.join(command)}\n"
                f"{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        if not os.path.exists(neff_path):
            raise RuntimeError(f"neuronx-cc exited 0 but wrote no {neff_path}: {shlex.join(command)}")
        with open(neff_path, "rb") as f:
            neff = f.read()
        return NeffArtifact(neff, neff_path, info, num_replicas, command)

    def deserialize(self, data: bytes, hlo_bytes: bytes, num_replicas: int = 1) -> NeffArtifact:
        info = ProgramInfo.from_bytes(hlo_bytes)
        digest = hashlib.sha256(hlo_bytes).hexdigest()[:24]
        neff_path = os.path.join(self.workdir, f"{digest}.neff")
        with open(neff_path, "wb") as f:
            f.write(data)
        return NeffArtifact(data, neff_path, info, num_replicas)

    def to_device(self, array: Any, replica: int = 0) -> Any:
        raise RuntimeError(f"the neuronx-cc backend has no devices: {_RUN_HINT}")

    def to_host(self, buffer: Any) -> np.ndarray:
        raise RuntimeError(f"the neuronx-cc backend has no devices: {_RUN_HINT}")

    def compiler_version(self) -> str:
        """`neuronx-cc --version`, or a note that it is not installed."""
        if self._version is None:
            if compiler_path() is None:
                return "neuronx-cc (not installed)"
            done = subprocess.run([COMPILER, "--version"], capture_output=True, text=True)
            self._version = (done.stdout or done.stderr).strip() or "neuronx-cc (unknown version)"
        return self._version

    def cache_key_parts(self) -> dict[str, str]:
        return {
            "backend": self.name,
            "platform": self.platform,
            "compiler_version": self.compiler_version(),
            "flags": shlex.join(["--target", self.target, *self.flags]),
        }

    def __repr__(self) -> str:
        return f"<NeuronCCBackend target={self.target} flags={self.flags}>"
