"""GGUF files converted once into a folder of f32 safetensors, for fast later opens.

Parsing a GGUF file and dequantizing its tensors takes seconds every time; the
converted folder (config.json + model.safetensors, memory-mapped) opens in a
fraction of that. The folder is keyed by the file's path, size and modification
time, written atomically, and skipped when PYHLO_GGUF_CACHE=0.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

from decoders.checkpoints.base import Checkpoint
from decoders.checkpoints.gguf import GGUFCheckpoint, _cache_key, load_cached_tokenizer
from decoders.checkpoints.hf import HFCheckpoint


def converted_dir(path: pathlib.Path) -> pathlib.Path | None:
    root = os.environ.get("PYHLO_GGUF_CACHE", str(pathlib.Path.home() / ".cache" / "pyhlo" / "converted"))
    if root in ("", "0"):
        return None
    return pathlib.Path(root) / f"{path.stem}-{_cache_key(path)}"


class ConvertedGGUF(HFCheckpoint):
    """The converted folder of a GGUF file; tokenizer and chat template still come from the GGUF."""

    def __init__(self, folder: pathlib.Path, source: pathlib.Path):
        self.source = source
        self._source_checkpoint: GGUFCheckpoint | None = None
        super().__init__(folder)

    def tokenizer(self):
        return load_cached_tokenizer(self.source) or self._gguf().tokenizer()

    def _gguf(self) -> GGUFCheckpoint:
        """The GGUF file itself, opened on first need (its blocks are not in the converted folder)."""
        if self._source_checkpoint is None:
            self._source_checkpoint = GGUFCheckpoint(self.source)
        return self._source_checkpoint

    def quant_type(self, name: str) -> str | None:
        return self._gguf().quant_type(name)

    def block_form(self, name: str) -> str | None:
        return self._gguf().block_form(name)

    def blocks(self, name: str):
        return self._gguf().blocks(name)

    def close(self) -> None:
        super().close()
        if self._source_checkpoint is not None:
            self._source_checkpoint.close()
            self._source_checkpoint = None

    def chat_template(self) -> str | None:
        template = self.path / "chat_template.jinja"
        return template.read_text() if template.exists() else None

    def __repr__(self) -> str:
        return f"ConvertedGGUF({str(self.source)!r})"


def convert(checkpoint: GGUFCheckpoint, target: pathlib.Path) -> None:
    """Write checkpoint's tensors (f32) and config into `target`, atomically."""
    from safetensors.numpy import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        tensors = {name: checkpoint.get(name, keep_dtype=True) for name in checkpoint.names()}
        save_file(tensors, str(staging / "model.safetensors"))
        (staging / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
        template = checkpoint.chat_template()
        if template:
            (staging / "chat_template.jinja").write_text(template)
        staging.replace(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # no space, or another process won the race


def open_gguf(path: pathlib.Path) -> Checkpoint:
    target = converted_dir(path)
    if target is not None and (target / "model.safetensors").is_file():
        return ConvertedGGUF(target, path)
    checkpoint = GGUFCheckpoint(path)
    if target is not None:
        convert(checkpoint, target)
    return checkpoint
