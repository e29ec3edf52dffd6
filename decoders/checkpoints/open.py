"""Open a model checkpoint and stream its tensors one at a time.

Two kinds of checkpoint are understood:

* a Hugging Face model directory: ``config.json`` plus one of ``model.safetensors``,
  ``model.safetensors.index.json`` (sharded), ``pytorch_model.bin`` or
  ``pytorch_model.bin.index.json`` (sharded);
* a ``.gguf`` file, or a directory holding exactly one (see ``decoders.checkpoints.gguf``).

Whatever the format, tensors are named as Hugging Face names them
(``model.layers.0.self_attn.q_proj.weight``) and come back as numpy arrays::

    with open_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf") as ckpt:
        hidden = ckpt.config["hidden_size"]
        for name in ckpt.names():
            weight = ckpt.get(name)  # float32 unless keep_dtype=True

``names()`` lists the tensors the checkpoint stores. A model with tied embeddings
(``config["tie_word_embeddings"]``) usually stores no ``lm_head.weight``: the LM head is then
``model.embed_tokens.weight``, and choosing it is the model code's job, not the loader's.
"""

from __future__ import annotations

import os
import pathlib

from decoders.checkpoints.base import Checkpoint, CheckpointError
from decoders.checkpoints.gguf_cache import open_gguf
from decoders.checkpoints.hf import WEIGHT_FILES, HFCheckpoint


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open an HF model directory, a .gguf file, or a directory holding exactly one .gguf."""
    path = pathlib.Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file or directory; pass a Hugging Face model directory "
            "(config.json plus weights) or a .gguf file"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return open_gguf(path)
        if path.name in WEIGHT_FILES or path.name == "config.json" or path.suffix in (".safetensors", ".bin"):
            raise CheckpointError(
                f"{path}: pass the directory that holds this file and its config.json "
                f"({path.parent}), not the file itself"
            )
        raise CheckpointError(
            f"{path}: unsupported checkpoint file type {path.suffix or '(no suffix)'!r}; supported are "
            "a Hugging Face model directory (config.json plus model.safetensors, pytorch_model.bin "
            "or their sharded .index.json) and a .gguf file"
        )
    hf_weights = (path / "config.json").is_file() and any((path / f).is_file() for f in WEIGHT_FILES)
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not hf_weights:
        if len(ggufs) > 1:
            raise CheckpointError(
                f"{path}: holds several .gguf files ({', '.join(g.name for g in ggufs)}); "
                "pass the path of the one to load"
            )
        return open_gguf(ggufs[0])
    return HFCheckpoint(path)
