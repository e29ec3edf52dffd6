"""save() writes a new directory and renames it into place: a kill at any moment leaves the
earlier save (or, between the two renames, none and the earlier one beside it), and load()
of a partial or mixed directory names it and says to save again."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from child_env import python_path

import runtime.atomic_directory as atomic_directory
from decoders import LlamaForSampling

TESTS = Path(__file__).resolve().parent
SHAPE = dict(batch_size=1, n_positions=128, context_length_estimate=[16])
PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture(scope="module")
def model(checkpoint):
    return LlamaForSampling.from_pretrained(checkpoint, **SHAPE).to_neuron()


@pytest.fixture(scope="module")
def expected(model):
    return model.sample(PROMPT, sequence_length=30, top_k=1, eos_token_id=[])


def loads_and_answers(checkpoint, directory, expected) -> None:
    loaded = LlamaForSampling.from_pretrained(checkpoint, **SHAPE).load(directory).to_neuron()
    assert loaded.programs.compiler_calls == 0 and loaded.programs.loaded_from_save > 0
    assert torch.equal(loaded.sample(PROMPT, sequence_length=30, top_k=1, eos_token_id=[]), expected)


# A second save of the same directory, killed (SIGKILL) once it has written part of the weights.
KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import decoders.session.presharded as presharded
    from decoders import LlamaForSampling

    checkpoint, directory = sys.argv[1:]
    model = LlamaForSampling.from_pretrained(checkpoint, batch_size=1, n_positions=128,
                                             context_length_estimate=[16]).to_neuron()

    def write_then_die(path, tensors, fetch, metadata=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"half a weight file")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    presharded.write = write_then_die
    model.save(directory, sharded_weights=True)
""")


def test_a_save_killed_midway_leaves_the_earlier_save_whole(model, checkpoint, expected, tmp_path):
    directory = tmp_path / "saved"
    model.save(directory, sharded_weights=True)
    env = dict(os.environ, PYTHONPATH=python_path(TESTS.parent, TESTS))
    done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(checkpoint), str(directory)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    (staging,) = tmp_path.glob(".saved.saving-*")          # the killed writer's half
    assert (staging / "weights" / "rank0.safetensors").read_bytes() == b"half a weight file"

    loads_and_answers(checkpoint, directory, expected)
    model.save(directory)                                  # the next save clears the dead writer's half
    assert not staging.exists() and not (directory / "weights").exists()
    loads_and_answers(checkpoint, directory, expected)


def test_a_save_failing_midway_leaves_the_earlier_save_and_no_litter(model, checkpoint, expected, tmp_path,
                                                                    monkeypatch):
    directory = tmp_path / "saved"
    model.save(directory, sharded_weights=True)

    def fail(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(model.session, "save_weights", fail)
    with pytest.raises(OSError, match="no space"):
        model.save(directory, sharded_weights=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    monkeypatch.undo()
    loads_and_answers(checkpoint, directory, expected)


def test_a_kill_between_the_renames_leaves_the_earlier_save_beside_and_load_says_where(
        model, checkpoint, expected, tmp_path, monkeypatch):
    directory = tmp_path / "saved"
    model.save(directory)
    renames = []

    def first_rename_only(source, destination):
        if renames:
            raise KeyboardInterrupt         # the process ends here
        renames.append(destination)
        os.rename(source, destination)

    monkeypatch.setattr(atomic_directory.os, "replace", first_rename_only)
    with pytest.raises(KeyboardInterrupt):
        model.save(directory)
    monkeypatch.undo()
    (aside,) = atomic_directory.interrupted_replacements(directory)
    with pytest.raises(ValueError, match=f"earlier save is in {aside}"):
        LlamaForSampling.from_pretrained(checkpoint, **SHAPE).load(directory)
    loads_and_answers(checkpoint, aside, expected)


def test_load_of_a_partial_or_mixed_directory_names_it_and_says_to_save_again(model, checkpoint, tmp_path):
    directory = tmp_path / "saved"
    model.save(directory, sharded_weights=True)
    fresh = LlamaForSampling.from_pretrained(checkpoint, **SHAPE)
    programs = sorted((directory / "programs").glob("*.exe"))

    mixed = tmp_path / "mixed"                 # one program overwritten by another's
    shutil.copytree(directory, mixed)
    (mixed / "programs" / programs[0].name).write_bytes(programs[1].read_bytes())
    with pytest.raises(ValueError, match=f"{mixed} is not what model.save\\(\\) wrote: programs/"
                                         f"{programs[0].name} .*save the model again"):
        fresh.load(mixed)

    truncated = tmp_path / "truncated"         # weights cut short
    shutil.copytree(directory, truncated)
    with open(truncated / "weights" / "rank0.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="rank0.safetensors has 100 bytes, not .*save the model again"):
        fresh.load(truncated)

    partial = tmp_path / "partial"             # written in place by an older save() and killed
    shutil.copytree(directory, partial)
    (partial / "pyhlo_model.json").unlink()
    with pytest.raises(ValueError, match=f"{partial} has no pyhlo_model.json: .*did not finish; save the"):
        fresh.load(partial)


def test_a_saved_program_that_xla_cannot_read_is_named(model, checkpoint, tmp_path):
    """A directory from before file lists were saved: XLA's own failure is reported with the file."""
    directory = tmp_path / "saved"
    model.save(directory)
    description = json.loads((directory / "pyhlo_model.json").read_text())
    del description["files"]
    (directory / "pyhlo_model.json").write_text(json.dumps(description))
    program = sorted((directory / "programs").glob("*.exe"))[0]
    program.write_bytes(b"not an executable")
    with pytest.raises(ValueError, match=f"{program} could not be loaded .*save the model again"):
        LlamaForSampling.from_pretrained(checkpoint, **SHAPE).load(directory).to_neuron()


def test_save_refuses_to_replace_a_directory_holding_other_files(model, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds notes.txt, which save\\(\\) did not write"):
        model.save(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
