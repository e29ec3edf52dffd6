"""Presharded weights: save(dir, sharded_weights=True) writes each replica's weights as it holds
them; load(dir) then places them with no checkpoint reading and no sharding work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from child_env import python_path

import decoders.session.session as session_module
from decoders import LlamaForSampling
from decoders.checkpoints.hf import _SafetensorsShard
from decoders.lowering import XlaLowering
from decoders.session import presharded

TESTS = Path(__file__).resolve().parent
SHAPE = dict(batch_size=1, n_positions=128, context_length_estimate=[16])
PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


@pytest.fixture(scope="module")
def saved(checkpoint, tmp_path_factory):
    model = LlamaForSampling.from_pretrained(checkpoint, **SHAPE).to_neuron()
    directory = tmp_path_factory.mktemp("presharded")
    model.save(directory, sharded_weights=True)
    return model, directory, model.sample(PROMPT, sequence_length=40, top_k=1, eos_token_id=[])


def forbid_sharding_work(monkeypatch, model):
    def boom(*args, **kwargs):
        raise AssertionError("presharded weights must not be read from the checkpoint or sharded")

    monkeypatch.setattr(session_module, "read", boom)
    monkeypatch.setattr(XlaLowering, "arrange", boom)
    monkeypatch.setattr(model.checkpoint, "get", boom)


def test_presharded_weights_load_as_saved_and_give_identical_tokens(saved, checkpoint, monkeypatch):
    model, directory, expected = saved
    manifest = json.loads((directory / "pyhlo_model.json").read_text())["sharded_weights"]
    assert (manifest["tp_degree"] == 1 and manifest["amp"] == "f32"
            and manifest["lowering"] == model.lowering.name)
    assert "batch_size" not in manifest
    stored = _SafetensorsShard(directory / "weights" / "rank0.safetensors")
    builder = model.session.builder
    expected_shapes = {presharded.tensor_name(p.name, None): builder.spec(p).dims
                       for p in builder.shared_params()}
    expected_shapes.update({presharded.tensor_name(p.name, i): builder.spec(p).dims
                            for i in range(builder.decoder.n_layers) for p in builder.layer_params()})
    assert stored.shapes() == expected_shapes

    loaded = LlamaForSampling.from_pretrained(checkpoint, **SHAPE).load(directory)
    forbid_sharding_work(monkeypatch, loaded)
    loaded.to_neuron()
    assert loaded.programs.compiler_calls == 0
    assert torch.equal(loaded.sample(PROMPT, sequence_length=40, top_k=1, eos_token_id=[]), expected)


def test_save_without_the_flag_writes_no_weights(saved, tmp_path):
    model = saved[0]
    model.save(tmp_path)
    assert not (tmp_path / "weights").exists()
    assert "sharded_weights" not in json.loads((tmp_path / "pyhlo_model.json").read_text())


def test_presharded_weights_made_for_another_model_are_refused(saved, checkpoint, tmp_path):
    directory = saved[1]
    with pytest.raises(ValueError, match="amp='f32', this model has 'bf16'"):
        LlamaForSampling.from_pretrained(checkpoint, amp="bf16", **SHAPE).load(directory)
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in directory.rglob("*"):
        if item.is_file():
            (copy / item.relative_to(directory)).parent.mkdir(parents=True, exist_ok=True)
            (copy / item.relative_to(directory)).write_bytes(item.read_bytes())
    description = json.loads((copy / "pyhlo_model.json").read_text())
    description["sharded_weights"]["lowering"] = "another-lowering"
    (copy / "pyhlo_model.json").write_text(json.dumps(description))
    with pytest.raises(ValueError, match="saved for lowering='another-lowering', this model has lowering="):
        LlamaForSampling.from_pretrained(checkpoint, **SHAPE).load(copy)


RUN = textwrap.dedent("""
    import json, sys, tempfile, pathlib
    import numpy as np
    import torch
    import decoders.session.session as session_module
    from decoders import LlamaForSampling
    from decoders.checkpoints.hf import _SafetensorsShard
    from decoders.lowering import XlaLowering
    from decoders.parallel.sharding import local_shape
    import tiny_llama

    path = tiny_llama.save(tiny_llama.make_model("gqa_tied_llama3"), pathlib.Path(tempfile.mkdtemp()),
                           "safetensors")
    shape = dict(batch_size=2, n_positions=128, context_length_estimate=[16], tp_degree=2)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]
    model = LlamaForSampling.from_pretrained(path, **shape).to_neuron()
    expected = model.sample(prompts, sequence_length=40, top_k=1, eos_token_id=[])
    directory = pathlib.Path(tempfile.mkdtemp())
    model.save(directory, sharded_weights=True)
    builder = model.session.builder
    names = {f"shared/{p.name}": p for p in builder.shared_params()}
    names.update({f"layer{i}/{p.name}": p for i in range(builder.decoder.n_layers)
                  for p in builder.layer_params()})
    files = [_SafetensorsShard(directory / "weights" / f"rank{r}.safetensors") for r in range(2)]
    shapes_ok = all(f.shapes() == {n: tuple(builder.spec(p).dims) for n, p in names.items()} for f in files)
    split = [n for n, p in names.items() if local_shape(p, 2) != tuple(p.shape)]
    ranks_differ = any(not np.array_equal(files[0].read(n), files[1].read(n)) for n in split)

    try:
        LlamaForSampling.from_pretrained(path, **dict(shape, tp_degree=1)).load(directory)
        refused = ""
    except ValueError as e:
        refused = str(e)

    def boom(*args, **kwargs):
        raise AssertionError("sharding work")

    loaded = LlamaForSampling.from_pretrained(path, **shape).load(directory)
    session_module.read = boom
    XlaLowering.arrange = boom
    loaded.checkpoint.get = boom
    loaded.to_neuron()
    again = loaded.sample(prompts, sequence_length=40, top_k=1, eos_token_id=[])
    print(json.dumps({"same": torch.equal(again, expected), "shapes_ok": shapes_ok, "split": len(split),
                      "ranks_differ": ranks_differ, "refused": refused}))
""")


def test_presharded_weights_at_tp2_load_per_rank_and_give_identical_tokens():
    env = dict(os.environ, PYTHONPATH=python_path(str(TESTS.parent), str(TESTS)),
               XLA_FLAGS="--xla_force_host_platform_device_count=2", PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] and result["shapes_ok"]
    assert result["split"] > 0 and result["ranks_differ"]
    assert "tp_degree=2, this model has 1" in result["refused"]
