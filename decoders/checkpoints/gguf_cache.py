"""GGUF files converted once into a folder of safetensors, for fast later opens.

Parsing a GGUF file and dequantizing its tensors takes seconds every time; the
converted folder (config.json + model.safetensors, memory-mapped) opens in a
fraction of that. Each tensor is kept once: one stored in a block form pyhlo runs as
stored (decoders/weights/stored.py: BLOCK_FORMS) as its blocks only
(blocks.safetensors: NAME:values, NAME:scales, NAME:mins; the forms, their shapes and
every tensor's GGML type in its metadata), widened from them when a later open widens
it; any other in model.safetensors, floats as stored and other quantized types in f32.
The folder is keyed by the file's path, size and modification time, written
atomically, and skipped when PYHLO_GGUF_CACHE=0.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import Collection

import numpy as np

from decoders.checkpoints.base import Checkpoint
from decoders.checkpoints.gguf import GGUFCheckpoint, _cache_key, load_cached_tokenizer
from decoders.checkpoints.hf import HFCheckpoint, _SafetensorsShard
from decoders.checkpoints.streamed_safetensors import write_streamed
from decoders.weights.quantize import dequantize_blocks
from decoders.weights.stored import BlockWeight
from runtime.host_memory import aligned_concatenate


def converted_dir(path: pathlib.Path) -> pathlib.Path | None:
    root = os.environ.get("PYHLO_GGUF_CACHE", str(pathlib.Path.home() / ".cache" / "pyhlo" / "converted"))
    if root in ("", "0"):
        return None
    return pathlib.Path(root) / f"{path.stem}-{_cache_key(path)}-{LAYOUT}"


# The converted folder's layout: a new one converts the file again. v4: tensors at 64-byte
# boundaries, block weights' values apart from their scales (placed from the mapping as stored).
LAYOUT = "v4"
BLOCKS = "blocks.safetensors"
BLOCK_PARTS = ("values", "scales", "mins")


class ConvertedGGUF(HFCheckpoint):
    """The converted folder of a GGUF file; tokenizer and chat template still come from the GGUF."""

    def __init__(self, folder: pathlib.Path, source: pathlib.Path):
        self.source = source
        self._source_checkpoint: GGUFCheckpoint | None = None
        self._blocks = None
        super().__init__(folder)
        # Plain reads, as model.safetensors: a mapping's pages would stay resident beside the
        # copies placed on the device.
        self._blocks = _SafetensorsShard(folder / BLOCKS)
        metadata = self._blocks.metadata()
        self._forms = json.loads(metadata.get("forms", "{}"))
        self._types = json.loads(metadata.get("types", "{}"))
        shapes = json.loads(metadata.get("shapes", "{}"))
        self._block_shapes = {name: tuple(shape) for name, shape in shapes.items()}

    # Tensors kept as blocks are not in model.safetensors: their names, shapes and floats come
    # from the blocks.
    def names(self) -> list[str]:
        return [*super().names(), *self._forms]

    def __contains__(self, name: str) -> bool:
        return name in self._forms or super().__contains__(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._forms:
            return self._block_shapes[name]
        return super().shape(name)

    def _read(self, name: str):
        if name in self._forms:
            return dequantize_blocks(self.blocks(name))
        return super()._read(name)

    def tokenizer(self):
        return load_cached_tokenizer(self.source) or self._gguf().tokenizer()

    def _gguf(self) -> GGUFCheckpoint:
        """The GGUF file itself, opened on first need (its blocks are not in the converted folder)."""
        if self._source_checkpoint is None:
            self._source_checkpoint = GGUFCheckpoint(self.source)
        return self._source_checkpoint

    def quant_type(self, name: str) -> str | None:
        self._require(name)
        return self._types.get(name)

    def block_form(self, name: str) -> str | None:
        self._require(name)
        return self._forms.get(name)

    def blocks(self, name: str) -> BlockWeight:
        form = self.block_form(name)
        if form is None:
            return self._gguf().blocks(name)     # names the GGML type it has instead
        return self.blocks_rows([name])

    def blocks_rows(self, names: list[str]) -> BlockWeight:
        forms = {self.block_form(name) for name in names}
        if None in forms or len(forms) > 1:
            return super().blocks_rows(names)
        stored = self._blocks.shapes()

        def joined(part: str) -> np.ndarray | None:
            if f"{names[0]}:{part}" not in stored:
                return None
            array = self._blocks.read_rows([f"{name}:{part}" for name in names])
            return array if array is not None else aligned_concatenate(
                [self._blocks.read(f"{name}:{part}") for name in names])

        return BlockWeight(forms.pop(), *(joined(part) for part in BLOCK_PARTS))

    def rows(self, names: list[str]) -> np.ndarray | None:
        if any(name in self._forms for name in names):      # widened from their blocks
            return Checkpoint.rows(self, names)
        return super().rows(names)

    def release_pages(self, kept: Collection[int] = ()) -> None:
        super().release_pages(kept)
        if self._blocks is not None:
            self._blocks.release_pages(kept)

    def close(self) -> None:
        super().close()
        self._blocks = None
        if self._source_checkpoint is not None:
            self._source_checkpoint.close()
            self._source_checkpoint = None

    def chat_template(self) -> str | None:
        template = self.path / "chat_template.jinja"
        return template.read_text() if template.exists() else None

    def __repr__(self) -> str:
        return f"ConvertedGGUF({str(self.source)!r})"


def convert(checkpoint: GGUFCheckpoint, target: pathlib.Path) -> None:
    """Write checkpoint's tensors (each once: as blocks, floats as stored, else f32) and config
    into `target`, atomically, one tensor in memory at a time."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        forms = {name: checkpoint.block_form(name) for name in checkpoint.names()
                 if checkpoint.block_form(name)}

        # Each tensor is read from the file's mapping, whose pages are dropped as it goes:
        # a pass over the whole file would otherwise leave all of it resident.
        def floats():
            from tqdm.auto import tqdm

            for name in tqdm([n for n in checkpoint.names() if n not in forms], desc="converting",
                             unit="tensor", disable=None):
                yield name, checkpoint.get(name, keep_dtype=True)
                checkpoint.release_pages()

        write_streamed(staging / "model.safetensors", floats())

        def blocks():
            for name in forms:
                weight = checkpoint.blocks(name)
                yield from ((f"{name}:{part}", getattr(weight, part)) for part in BLOCK_PARTS
                            if getattr(weight, part) is not None)
                checkpoint.release_pages()

        types = {name: checkpoint.quant_type(name) for name in checkpoint.names()}
        shapes = {name: checkpoint.shape(name) for name in forms}
        # Values, then scales, then minimums: a fused weight's parts lie one after another.
        write_streamed(staging / BLOCKS, blocks(), metadata={
            "forms": json.dumps(forms), "types": json.dumps(types), "shapes": json.dumps(shapes)},
            group=lambda name: BLOCK_PARTS.index(name.rpartition(":")[2]))
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
    if target is not None:
        import logging

        logging.getLogger("pyhlo.progress").info("converting %s to safetensors for fast loading (once) ...",
                                                 path.name)
    checkpoint = GGUFCheckpoint(path)
    if target is not None:
        convert(checkpoint, target)
        if (target / "model.safetensors").is_file():
            # Read as later opens read it: plain reads, not the GGUF mapping the conversion touched.
            checkpoint.close()
            return ConvertedGGUF(target, path)
    return checkpoint
