"""The neuronx-cc backend: the command line it runs, the files it writes and reads, its errors."""
from __future__ import annotations

import os
import stat

import pytest

from pyhlo import compile_py_func
from runtime import get_backend
from runtime.neuronx_cc import NeffArtifact, NeuronCCBackend


def double(scribe):
    x = scribe.f32[8].Parameter(parameter_number=0, name="x")
    return scribe.f32[8].Add(x, x)


HLO = compile_py_func(double).SerializeToString()

# Stands in for the neuronx-cc executable: it checks the arguments it is given and
# writes an output file, nothing more.
FAKE_NEURONX_CC = """#!/bin/sh
[ "$1" = compile ] && [ "$2" = --framework ] && [ "$3" = XLA ] || { echo "bad arguments: $*" >&2; exit 2; }
[ -f "$4" ] || { echo "no input file $4" >&2; exit 2; }
[ "$5" = --target ] && [ "$7" = --output ] || { echo "bad arguments: $*" >&2; exit 2; }
printf 'NEFF target=%s extra=%s' "$6" "$9" > "$8"
"""


def put_on_path(monkeypatch, tmp_path, script: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "neuronx-cc"
    program.write_text(script)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_command_line(monkeypatch):
    monkeypatch.delenv("NEURON_TARGET", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    assert NeuronCCBackend().build_command("m.pb", "m.neff") == [
        "neuronx-cc", "compile", "--framework", "XLA", "m.pb", "--target", "trn1", "--output", "m.neff"]
    backend = NeuronCCBackend(target="inf2", flags="--auto-cast none -O2")
    assert backend.build_command("m.pb", "m.neff")[5:] == ["--target", "inf2", "--output", "m.neff",
                                                           "--auto-cast", "none", "-O2"]


def test_target_and_flags_from_environment(monkeypatch):
    monkeypatch.setenv("NEURON_TARGET", "trn2")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer")
    assert NeuronCCBackend().build_command("m.pb", "m.neff")[6:] == [
        "trn2", "--output", "m.neff", "--model-type=transformer"]
    with pytest.raises(ValueError, match="valid targets: trn1, inf2, trn2"):
        NeuronCCBackend(target="trn3")


def test_module_file_is_the_module_bytes(tmp_path):
    path = NeuronCCBackend(workdir=str(tmp_path)).write_module(HLO)
    assert path.endswith(".pb") and os.path.dirname(path) == str(tmp_path)
    with open(path, "rb") as f:
        assert f.read() == HLO


def test_compile_runs_neuronx_cc_and_reads_the_neff(monkeypatch, tmp_path):
    """A fake `neuronx-cc` on PATH stands in only for the executable, to test our command
    line and file handling; it is not a compiler."""
    put_on_path(monkeypatch, tmp_path, FAKE_NEURONX_CC)
    backend = NeuronCCBackend(target="inf2", flags=["--extra"], workdir=str(tmp_path / "work"))

    artifact = backend.compile(HLO)

    assert isinstance(artifact, NeffArtifact)
    assert artifact.neff_bytes == b"NEFF target=inf2 extra=--extra"
    assert artifact.neff_path.endswith(".neff") and os.path.exists(artifact.neff_path)
    assert artifact.command == backend.build_command(artifact.neff_path[:-5] + ".pb", artifact.neff_path)
    assert artifact.parameter_names == ("x",)
    with pytest.raises(RuntimeError, match="Neuron runtime"):
        artifact.run({"x": [0.0] * 8})


def test_compiler_failure_shows_its_output(monkeypatch, tmp_path):
    put_on_path(monkeypatch, tmp_path, "#!/bin/sh\necho 'unsupported op' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="(?s)exit 1.*unsupported op"):
        NeuronCCBackend(workdir=str(tmp_path / "work")).compile(HLO)


def test_missing_compiler_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    backend = get_backend("neuronx-cc")
    with pytest.raises(RuntimeError, match="install neuronx-cc from the AWS Neuron SDK"):
        backend.compile(HLO)
    assert backend.cache_key_parts()["compiler_version"] == "neuronx-cc (not installed)"
