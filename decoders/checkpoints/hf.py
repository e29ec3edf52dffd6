"""A Hugging Face model directory: ``config.json`` plus one of ``model.safetensors``,
``model.safetensors.index.json`` (sharded), ``pytorch_model.bin`` or
``pytorch_model.bin.index.json`` (sharded), read one tensor at a time."""

from __future__ import annotations

import json
import pathlib
from typing import Collection

import ml_dtypes
import numpy as np

from decoders.checkpoints.base import Checkpoint, CheckpointError
from runtime.host_memory import ALIGNMENT, MappedFile, aligned_empty

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
# In order of preference: safetensors need no unpickling and map straight from disk.
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS_FILE, TORCH_INDEX, TORCH_FILE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

class _SafetensorsShard:
    """A .safetensors file, read one tensor (or one run of tensors) at a time.

    A tensor that lies at a 64-byte boundary of the file comes back as a read-only view of
    the file's mapping, which XLA:CPU then places with no copy at all; any other is read
    with plain file reads into an aligned array (one copy, and no mapping left resident).
    release_pages() drops the mapped pages of views that were copied rather than placed.
    The format is an 8-byte header length, a JSON header, then the raw tensors.
    """

    _DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
               "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
               "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}

    def __init__(self, path: pathlib.Path):
        self._path = path
        with open(path, "rb") as f:
            (length,) = np.frombuffer(f.read(8), dtype="<u8")
            header = json.loads(f.read(int(length)))
        self._metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + int(length)
        self._entries = header
        self._mapped: MappedFile | None = None

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(entry["shape"]) for name, entry in self._entries.items()}

    def read(self, name: str) -> np.ndarray:
        return self.read_rows([name])

    def read_rows(self, names: list[str]) -> np.ndarray | None:
        """The tensors joined along their first axis (None where their types or trailing dims
        differ): one view of the file where they lie one after another in that order."""
        entries = [self._entries[name] for name in names]
        dtypes = {entry["dtype"] for entry in entries}
        trailing = {tuple(entry["shape"][1:]) for entry in entries}
        if len(names) > 1 and (len(dtypes) > 1 or len(trailing) > 1 or not all(e["shape"] for e in entries)):
            return None
        dtype = np.dtype(self._DTYPES[entries[0]["dtype"]])
        shape = tuple(entries[0]["shape"]) if len(names) == 1 else (
            sum(entry["shape"][0] for entry in entries), *trailing.pop())
        begin = self._data_start + entries[0]["data_offsets"][0]
        running = all(a["data_offsets"][1] == b["data_offsets"][0] for a, b in zip(entries, entries[1:]))
        if running and begin % ALIGNMENT == 0:
            if self._mapped is None:
                self._mapped = MappedFile(self._path)
            try:
                return self._mapped.view(begin, shape, dtype)
            except ValueError as error:     # numpy: the mapping is smaller than the view
                raise CheckpointError(f"{self._path}: tensor {names[-1]!r} is truncated") from error
        array = aligned_empty(shape, dtype)
        into = memoryview(array.reshape(-1).view(np.uint8))
        with open(self._path, "rb") as f:
            for name, entry in zip(names, entries):
                start, end = entry["data_offsets"]
                f.seek(self._data_start + start)
                if f.readinto(into[:end - start]) != end - start:
                    raise CheckpointError(f"{self._path}: tensor {name!r} is truncated")
                into = into[end - start:]
        return array

    def release_pages(self, kept: Collection[int] = ()) -> None:
        if self._mapped is not None:
            self._mapped.release_copied(kept)

    def close(self) -> None:
        # Views the device holds keep the mapping itself alive.
        if self._mapped is not None:
            self._mapped.close()
        self._mapped = None


class _TorchShard:
    def __init__(self, path: pathlib.Path):
        import torch

        # mmap: tensors stay on disk until read, so memory stays near one tensor, not the shard.
        try:
            self._state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot read this PyTorch weights file ({type(e).__name__}: {e}). "
                "Only the zip format torch.save has written since PyTorch 1.6 can be memory-mapped; "
                "re-save it, or convert the checkpoint to safetensors."
            ) from e

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self._state.items()}

    def read(self, name: str) -> np.ndarray:
        return _torch_to_numpy(self._state[name])

    def close(self) -> None:
        self._state = None


def _torch_to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().contiguous()
    as_ml_dtype = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
    }
    if tensor.dtype in as_ml_dtype:
        bits, dtype = as_ml_dtype[tensor.dtype]
        return tensor.view(bits).numpy().view(dtype).copy()
    # copy: the tensor may be a view of the memory-mapped file.
    return tensor.numpy().copy()


class HFCheckpoint(Checkpoint):
    """A Hugging Face model directory, single-file or sharded, safetensors or PyTorch .bin."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(
                f"{path}: no config.json in this directory; pass a Hugging Face model directory "
                "(config.json plus weights) or a .gguf file"
            )
        try:
            self.config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise CheckpointError(f"{path}: no weights file found; looked for {', '.join(WEIGHT_FILES)}")
        self.weights_path = weights
        self._shapes: dict[str, tuple[int, ...]] = {}
        # One shard open at a time: a torch .bin shard keeps a mapping of the whole file.
        self._open_file: pathlib.Path | None = None
        self._open_shard = None
        # Shards read from since the last release_pages(), no longer open.
        self._retired: list[_SafetensorsShard] = []
        self._shard_type = _SafetensorsShard if "safetensors" in weights.name else _TorchShard
        if weights.name.endswith(".index.json"):
            self._files = self._read_index(weights)
        else:
            self._load_shard(weights)
            self._files = {name: weights for name in self._shapes}

    def _read_index(self, index_path: pathlib.Path) -> dict[str, pathlib.Path]:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index_path}: not a valid shard index (expected JSON with a 'weight_map' "
                f"object mapping tensor names to shard files): {e}"
            ) from e
        files = {name: self.path / shard for name, shard in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(
                f"{index_path} names shard(s) missing from {self.path}: {', '.join(missing)}; "
                "download or copy the missing shard files next to the index"
            )
        return files

    def _load_shard(self, file: pathlib.Path):
        if file != self._open_file:
            if isinstance(self._open_shard, _SafetensorsShard):
                # Its copied views' pages are dropped at the next release_pages().
                self._retired.append(self._open_shard)
                self._open_shard = None
            self.close()
            self._open_shard = self._shard_type(file)
            self._open_file = file
            self._shapes.update(self._open_shard.shapes())
        return self._open_shard

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        self._require(name)
        if name not in self._shapes:
            self._load_shard(self._files[name])
        return self._shapes[name]

    def _read(self, name: str) -> np.ndarray:
        return self._load_shard(self._files[name]).read(name)

    def rows(self, names: list[str]) -> np.ndarray | None:
        files = {self._files[name] for name in names if name in self}
        if self._shard_type is not _SafetensorsShard or len(files) != 1 or len(names) != len(set(names)):
            return super().rows(names)
        for name in names:
            self._require(name)
        return self._load_shard(files.pop()).read_rows(names)

    def release_pages(self, kept: Collection[int] = ()) -> None:
        for shard in self._retired:
            shard.release_pages(kept)
            shard.close()
        self._retired = []
        if isinstance(self._open_shard, _SafetensorsShard):
            self._open_shard.release_pages(kept)

    def _where(self) -> str:
        files = sorted({f.name for f in self._files.values()}) or [self.weights_path.name]
        return f"{self.path} ({', '.join(files)})"

    def tokenizer(self):
        if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(f"{self.path}: no tokenizer files; looked for {', '.join(TOKENIZER_FILES)}")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)

    def chat_template(self) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tokenizer_config = self.path / "tokenizer_config.json"
        if tokenizer_config.is_file():
            template = json.loads(tokenizer_config.read_text()).get("chat_template")
            return template if isinstance(template, str) else None
        return None

    def close(self) -> None:
        for shard in self._retired:
            shard.close()
        self._retired = []
        if self._open_shard is not None:
            self._open_shard.close()
        self._open_shard = None
        self._open_file = None


