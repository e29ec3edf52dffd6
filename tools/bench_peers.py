"""The peers `pyhlo bench` measures against, on the same weights: HF transformers and llama.cpp.

A runner loads a model for one precision and batch size, then `generate(prompts, new_tokens)`
produces exactly `new_tokens` greedy tokens per line (EOS ignored) and returns when each
token appeared, so that every engine is timed the same way.

llama.cpp reads GGUF only, and quantized weights would not be the weights the other engines
run. `dense_gguf` writes the dequantized tensors of the source GGUF (read through our own
checkpoint loader) as an F32 or BF16 GGUF, metadata and tokenizer copied, and keeps it in the
model cache.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import time
from typing import Any, Sequence

import numpy as np

AMP_TO_TORCH = {"f32": "float32", "bf16": "bfloat16"}


class TimingStreamer:
    """A generation streamer that only notes when each put() happens.

    Both our sample() and HF's generate() put the prompt first, then each new token.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def token_times(self, started: float) -> list[float]:
        """Seconds from `started` to each new token (the prompt's put left out)."""
        return [t - started for t in self.times[1:]]


def generation_record(started: float, token_times: list[float], finished: float,
                      tokens: list[list[int]]) -> dict:
    return {"ttft_s": token_times[0], "total_s": finished - started, "token_times_s": token_times,
            "tokens": [[int(t) for t in line] for line in tokens]}


# -- HF transformers -----------------------------------------------------------------
class HFRunner:
    """HF transformers' eager PyTorch model and generate()."""

    engine = "hf"

    def __init__(self, model_path: str, amp: str, batch: int, threads: int, **_: Any):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        dtype = getattr(torch, AMP_TO_TORCH[amp])
        path = pathlib.Path(model_path)
        if path.suffix == ".gguf":
            # transformers dequantizes the GGUF the way our loader does (checked: equal tensors);
            # it needs the accelerate package for that.
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        self.model = model.eval()
        self.torch = torch
        self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "dtype": str(dtype), "attn_implementation": model.config._attn_implementation,
                     "threads": torch.get_num_threads()}

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
        from transformers import GenerationConfig

        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        # min_new_tokens = max_new_tokens and no EOS: exactly new_tokens tokens per line.
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=0)
        streamer = TimingStreamer()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=streamer)
        finished = time.perf_counter()
        new = out[:, ids.shape[1]:].tolist()
        if len(new[0]) != new_tokens:
            raise RuntimeError(f"HF generate() made {len(new[0])} tokens, asked for {new_tokens}")
        return generation_record(started, streamer.token_times(started), finished, new)


# -- llama.cpp -----------------------------------------------------------------------
def llamacpp_available() -> str | None:
    """None if llama-cpp-python can be imported, else why not."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'pyhlo[llamacpp]')"
    return None


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API: one sequence per batch line, greedy argmax.

    The high-level `Llama` object serves one sequence; batches go through llama_decode with a
    sequence id per line, as llama.cpp's own batched example does. Context settings are
    llama.cpp's defaults (its KV cache is f16) except the thread count.
    """

    engine = "llamacpp"

    def __init__(self, model_path: str, amp: str, batch: int, threads: int, n_positions: int,
                 prompt_tokens: int, **_: Any):
        import llama_cpp

        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        lib.llama_log_set(_silent_log(), None)
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = lib.llama_context_default_params()
        params.n_ctx = batch * n_positions
        params.n_seq_max = batch
        params.n_batch = params.n_ubatch = max(512, batch * prompt_tokens)
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch_size = batch
        self.batch = lib.llama_batch_init(params.n_batch, 0, 1)
        self.info = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "threads": threads,
                     "kv_cache": "f16 (llama.cpp default)",
                     "system_info": lib.llama_print_system_info().decode(errors="replace").strip()}

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits

    def _decode_argmax(self, rows: list[int]) -> list[int]:
        if self.lib.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, r),
                                                     shape=(self.n_vocab,)))) for r in rows]

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        length = len(prompts[0])
        started = time.perf_counter()
        self._fill([(int(t), i, s, i == length - 1) for s, line in enumerate(prompts)
                    for i, t in enumerate(line)])
        tokens = [[t] for t in self._decode_argmax([s * length + length - 1 for s in range(len(prompts))])]
        times = [time.perf_counter() - started]
        for step in range(1, new_tokens):
            self._fill([(line[-1], length + step - 1, s, True) for s, line in enumerate(tokens)])
            for line, t in zip(tokens, self._decode_argmax(list(range(len(prompts))))):
                line.append(t)
            times.append(time.perf_counter() - started)
        finished = time.perf_counter()
        return generation_record(started, times, finished, tokens)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


_LOG_CALLBACK: list = []  # the ctypes callback must outlive every llama.cpp call


def _silent_log():
    """A log callback that drops llama.cpp's messages (it logs every tensor it loads)."""
    if not _LOG_CALLBACK:
        import llama_cpp

        _LOG_CALLBACK.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
    return _LOG_CALLBACK[0]


# -- dense GGUF files for llama.cpp ----------------------------------------------------
def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order of a q or k projection: the inverse of
    decoders.checkpoints.gguf.unpermute_rope_rows (HF pairs rows i and i + head_dim/2 of a
    head, llama.cpp rows 2i and 2i+1)."""
    half = weight.shape[0] // n_heads // 2
    by_head = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return by_head.swapaxes(1, 2).reshape(weight.shape)


def dense_gguf_path(source: pathlib.Path, amp: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Where the dense copy of `source` lives: keyed by the source's path, size and mtime."""
    if cache_dir is None:
        from decoders.checkpoints.default_model import default_cache_dir

        cache_dir = default_cache_dir() / "dense"
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / f"{source.stem}-{key}.{amp}.gguf"


def dense_gguf(source: str | os.PathLike, amp: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """An F32 or BF16 GGUF of the source's weights as our loader dequantizes them (cached)."""
    source = pathlib.Path(source)
    target = dense_gguf_path(source, amp, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        write_dense_gguf(source, pathlib.Path(partial), amp)
        os.replace(partial, target)
    except BaseException:
        pathlib.Path(partial).unlink(missing_ok=True)
        raise
    return target


def write_dense_gguf(source: pathlib.Path, target: pathlib.Path, amp: str) -> None:
    import gguf

    from decoders.checkpoints.gguf import ARCHITECTURES, GGUFCheckpoint

    kinds = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
             "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16)}
    if amp not in kinds:
        raise ValueError(f"no dense GGUF for amp {amp!r}; choose from {', '.join(kinds)}")
    kind, file_type = kinds[amp]
    reader = gguf.GGUFReader(source)
    arch_name = reader.fields["general.architecture"].contents()
    arch = ARCHITECTURES[arch_name]
    writer = gguf.GGUFWriter(target, arch_name)
    skipped = {"general.architecture", "general.file_type", "general.quantization_version"}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(file_type)

    checkpoint = GGUFCheckpoint(source)
    config = checkpoint.config
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf_name = f"model.layers.{parts[1]}.{arch.block_tensors[parts[2]]}.{suffix}"
            heads_key = arch.rope_permuted.get(parts[2])
        else:
            hf_name, heads_key = f"{arch.global_tensors[base]}.{suffix}", None
        array = checkpoint.get(hf_name)  # float32, HF row order
        if heads_key is not None:
            array = permute_rope_rows(array, config[heads_key])
        if array.ndim >= 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:  # norms stay F32, as llama.cpp's converter keeps them
            writer.add_tensor(tensor.name, np.ascontiguousarray(array, dtype=np.float32))
    checkpoint.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
