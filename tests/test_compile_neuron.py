"""`pyhlo compile`: every program of a model written as the neuronx-cc backend receives it,
with the exact neuronx-cc command line for each, and --compile running those commands."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_env import python_path

from runtime import get_backend
from runtime.neuronx_cc import NeuronCCBackend, neuronx_cc_command
from tools.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
FLAGS = "--model-type transformer -O1"


def reference_model(path, tp_degree: int = 1):
    """The model as the library builds it for the neuronx-cc backend."""
    from decoders import NeuronAutoModelForCausalLM

    return NeuronAutoModelForCausalLM.from_pretrained(
        path, n_positions=256, tp_degree=tp_degree, backend=NeuronCCBackend(target="inf2", cores=tp_degree))


def pyhlo_compile(capsys, *argv) -> tuple[int, str, str]:
    code = main(["compile", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def script_commands(directory: Path) -> list[list[str]]:
    """The command lines of compile.sh, after its comments, `set` and `cd` lines."""
    lines = (directory / "compile.sh").read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert 'cd "$(dirname "$0")"' in lines
    body = lines[lines.index('cd "$(dirname "$0")"') + 1:]
    return [shlex.split(line) for line in body]


@pytest.fixture
def checkpoint(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture
def dumped(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEURON_CC_FLAGS", FLAGS)
    out = tmp_path / "neuron"
    code, stdout, _ = pyhlo_compile(capsys, checkpoint, "--target", "inf2", "--dump", out, "--n-positions",
                                    256)
    assert code == 0
    assert f"bash {out / 'compile.sh'}" in stdout
    return out


def test_every_program_is_written_as_built_with_its_exact_command(checkpoint, dumped):
    model = reference_model(checkpoint)
    programs = [model.programs.build(key) for key in model.eager_programs()]
    manifest = read_manifest(dumped)

    assert [p["name"] for p in manifest["programs"]] == [p.name for p in programs]
    assert ({"block_n1_s256", "block_n64_s64", "embed_n1", "lm_head_n1", "greedy"}
            <= {p.name for p in programs})
    assert manifest["target"] == "inf2" and manifest["tp_degree"] == 1
    assert manifest["token_buckets"] == [128, 256] and manifest["context_buckets"] == [64, 128]
    assert manifest["neuron_cc_flags"] == ["--model-type", "transformer", "-O1"]
    for program, entry in zip(programs, manifest["programs"]):
        name = program.name
        module_bytes = (dumped / f"{name}.pb").read_bytes()
        assert module_bytes == program.module.SerializeToString()
        assert entry["pb"] == f"{name}.pb" and entry["neff"] == f"{name}.neff"
        assert entry["sha256"] == hashlib.sha256(module_bytes).hexdigest()
        assert entry["num_replicas"] == 1 and entry["target"] == "inf2"
        assert entry["parameters"] == program.param_names and entry["outputs"] == list(program.outputs)
        assert entry["command"] == ["neuronx-cc", "compile", "--framework", "XLA", f"{name}.pb",
                                    "--target", "inf2", "--output", f"{name}.neff",
                                    "--model-type", "transformer", "-O1"]
    # compile.sh holds the same commands, one line per program, in the same order.
    assert script_commands(dumped) == [entry["command"] for entry in manifest["programs"]]
    assert os.access(dumped / "compile.sh", os.X_OK)


def test_the_backend_builds_the_same_command():
    backend = NeuronCCBackend(target="trn2", flags=FLAGS)
    assert backend.build_command("m.pb", "m.neff") == neuronx_cc_command("m.pb", "m.neff", "trn2",
                                                                         FLAGS.split())
    with pytest.raises(ValueError, match="valid targets"):
        neuronx_cc_command("m.pb", "m.neff", "trn3")


def test_xla_accepts_every_dumped_program(dumped):
    backend = get_backend("xla", "cpu")
    for entry in read_manifest(dumped)["programs"]:
        executable = backend.compile((dumped / entry["pb"]).read_bytes(), num_replicas=entry["num_replicas"])
        assert list(executable.parameter_names) == entry["parameters"]


def test_compile_without_neuronx_cc_says_to_dump_and_compile_on_a_neuron_host(checkpoint, tmp_path,
                                                                               monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "neuron"
    code, _, err = pyhlo_compile(capsys, checkpoint, "--target", "trn1", "--dump", out, "--compile")
    assert code == 2
    assert "--compile needs neuronx-cc, which is not on PATH" in err
    assert f"bash {out}/compile.sh" in err and "without --compile" in err
    assert not out.exists()


# A stand-in named `neuronx-cc` that records how it was called and writes the --output file
# so that the caller's file check passes. It is not a compiler: what it writes is no NEFF.
RECORDER = """#!{python}
import json, os, sys, uuid
args = sys.argv[1:]
record = {{"argv": ["neuronx-cc", *args], "cwd": os.getcwd()}}
with open(os.path.join({records!r}, uuid.uuid4().hex + ".json"), "w") as f:
    json.dump(record, f)
if {fail!r} in args:
    print("recorder told to fail on " + {fail!r}, file=sys.stderr)
    sys.exit(1)
with open(args[args.index("--output") + 1], "w") as f:
    f.write("written by the test's argv recorder, not a NEFF")
"""


def put_recorder_on_path(monkeypatch, tmp_path, fail: str = "") -> Path:
    records = tmp_path / "records"
    records.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "neuronx-cc"
    program.write_text(RECORDER.format(python=sys.executable, records=str(records), fail=fail))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return records


def test_compile_runs_exactly_the_dumped_commands_in_the_dump_directory(checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    records = put_recorder_on_path(monkeypatch, tmp_path)
    monkeypatch.setenv("NEURON_CC_FLAGS", FLAGS)
    out = tmp_path / "neuron"
    code, stdout, err = pyhlo_compile(capsys, checkpoint, "--target", "inf2", "--dump", out, "--n-positions",
                                      256, "--compile", "--jobs", 2)
    assert code == 0, err

    calls = [json.loads(p.read_text()) for p in records.iterdir()]
    manifest = read_manifest(out)
    assert sorted(c["argv"] for c in calls) == sorted(p["command"] for p in manifest["programs"])
    assert {c["cwd"] for c in calls} == {str(out)}
    for entry in manifest["programs"]:
        assert (out / entry["neff"]).exists()
    assert f"ran neuronx-cc on {len(manifest['programs'])} programs" in stdout


def test_a_failing_command_is_named_with_its_output(checkpoint, tmp_path, monkeypatch, capsys):
    put_recorder_on_path(monkeypatch, tmp_path, fail="block_n64_s64.pb")
    out = tmp_path / "neuron"
    code, _, err = pyhlo_compile(capsys, checkpoint, "--target", "trn1", "--dump", out, "--n-positions", 256,
                                 "--compile")
    assert code == 1
    assert "block_n64_s64: neuronx-cc failed (exit 1)" in err
    assert "recorder told to fail on block_n64_s64.pb" in err
    assert "1 of 12 programs failed" in err         # 12: the samplers of top_k 1 and 50 among them
    assert not (out / "block_n64_s64.neff").exists() and (out / "block_n1_s256.neff").exists()


def test_help_answers_where_and_how(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for needed in ("neuronx-cc compile --framework XLA NAME.pb --target TARGET --output NAME.neff",
                   "NEURON_CC_FLAGS", "bash DIR/compile.sh", "--tp-degree", "NEURON_RT_VISIBLE_CORES",
                   "NEURON_RT_NUM_CORES", "PYHLO_PLATFORM=neuron", "examples:"):
        assert needed in text


XLA_COMPILES_REPLICATED = textwrap.dedent("""
    import json, pathlib, sys
    from runtime import get_backend
    directory = pathlib.Path(sys.argv[1])
    backend = get_backend("xla", "cpu")
    for entry in json.loads((directory / "manifest.json").read_text())["programs"]:
        backend.compile((directory / entry["pb"]).read_bytes(), num_replicas=entry["num_replicas"])
    print("compiled", backend.device_count)
""")


def test_tp_degree_2_writes_replicated_programs(checkpoint, tmp_path, capsys):
    from decoders import NotSupportedYet

    try:
        model = reference_model(checkpoint, tp_degree=2)
    except NotSupportedYet:
        pytest.skip("tensor parallelism not built")
    out = tmp_path / "neuron"
    code, _, err = pyhlo_compile(capsys, checkpoint, "--target", "inf2", "--tp-degree", 2, "--dump", out,
                                 "--n-positions", 256)
    assert code == 0, err
    manifest = read_manifest(out)
    assert manifest["tp_degree"] == 2
    programs = {p.name: p for p in (model.programs.build(key) for key in model.eager_programs())}
    assert [entry["name"] for entry in manifest["programs"]] == list(programs)
    for entry in manifest["programs"]:
        assert entry["num_replicas"] == 2
        assert (out / entry["pb"]).read_bytes() == programs[entry["name"]].module.SerializeToString()
        assert entry["command"][:9] == ["neuronx-cc", "compile", "--framework", "XLA", entry["pb"],
                                        "--target", "inf2", "--output", entry["neff"]]
    assert any(i.opcode == "all-reduce" for c in programs["block_n1_s256"].module.computations
               for i in c.instructions)
    # XLA:CPU shows two devices only when XLA_FLAGS asks before jax starts: a fresh process.
    env = dict(os.environ, PYTHONPATH=python_path(REPO_ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", XLA_COMPILES_REPLICATED, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("compiled 2")
