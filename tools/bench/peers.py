"""The peers `pyhlo bench` measures against, on the same weights: HF transformers (eager, or
with a static KV cache and torch.compile) and llama.cpp.

A runner loads a model for one precision and batch size, then `generate(prompts, new_tokens)`
produces exactly `new_tokens` greedy tokens per line (EOS ignored) and returns when each
token appeared, so that every engine is timed the same way.

llama.cpp reads GGUF only, and the source's quantized weights would not be the weights the
other engines run. `peer_gguf` writes the dequantized tensors of the source GGUF (read
through our own checkpoint loader) as an F32 or BF16 GGUF, or for int8 weights (amp "s8") a
Q8_0 one, metadata and tokenizer copied, and keeps it in the model cache.

Int8 weights, side by side: pyhlo stores each layer's linear weights as int8 with one f32
scale per row; llama.cpp runs the same matrices as Q8_0 (int8 with one f16 scale per 32
values); HF transformers runs PyTorch's dynamic int8 quantization of the layers' Linear
modules. The embeddings, the LM head and the norms stay f32 in all three.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import time
from typing import Any, Sequence

import numpy as np

# Element type of the unquantized weights; "s8" is int8 weights over an f32 model.
AMP_TO_TORCH = {"f32": "float32", "bf16": "bfloat16", "s8": "float32"}


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

    def __init__(self, model_path: str, amp: str, batch: int, threads: int, device: str = "cpu", **_: Any):
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
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.torch = torch
        self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                     "dtype": str(dtype), "attn_implementation": model.config._attn_implementation,
                     "threads": torch.get_num_threads(), "device": str(self.device)}
        if amp == "s8":
            self.info["quantized"] = quantize_layers_dynamic(model)

    def generation_config(self, new_tokens: int) -> Any:
        from transformers import GenerationConfig

        # min_new_tokens = max_new_tokens and no EOS: exactly new_tokens tokens per line.
        return GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                eos_token_id=None, pad_token_id=0)

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        config = self.generation_config(new_tokens)
        # generate() hands each token to the streamer on the host (a GPU's work is done by then).
        streamer = TimingStreamer()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=streamer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        finished = time.perf_counter()
        new = out[:, ids.shape[1]:].tolist()
        if len(new[0]) != new_tokens:
            raise RuntimeError(f"HF generate() made {len(new[0])} tokens, asked for {new_tokens}")
        return generation_record(started, streamer.token_times(started), finished, new)


class HFCompiledRunner(HFRunner):
    """HF transformers with a static KV cache and torch.compile, the way generate() offers it:
    cache_implementation="static" plus a CompileConfig, so each decode step runs the model's
    forward compiled by inductor for fixed shapes (prefill stays eager). On a GPU the mode is
    "reduce-overhead" (the step is replayed as a CUDA graph); on a CPU, where CUDA graphs do
    not exist, inductor's "default", and generate() is told to compile there too. The first
    generation compiles; the bench's warm-up covers it."""

    engine = "hf-compiled"

    def __init__(self, model_path: str, amp: str, batch: int, threads: int, device: str = "cpu", **rest: Any):
        super().__init__(model_path, amp, batch, threads, device=device, **rest)
        from transformers import CompileConfig

        on_gpu = self.device.type == "cuda"
        self.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if on_gpu else "default")
        if not on_gpu:
            # generate() compiles on accelerators only unless this flag says otherwise.
            self.compile_config._compile_all_devices = True
        self.info.update(cache_implementation="static", compile=self.compile_config.to_dict())

    def generation_config(self, new_tokens: int) -> Any:
        config = super().generation_config(new_tokens)
        config.cache_implementation = "static"
        config.compile_config = self.compile_config
        return config


def quantize_layers_dynamic(model: Any) -> str:
    """PyTorch's CPU int8 path on the decoder layers' Linear modules, in place: int8 weights
    (one scale per output row, as pyhlo's), activations quantized per product at run time.
    The LM head stays f32, as pyhlo's does. Returns what was done, for the report."""
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    layers = model.get_decoder().layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        quantize_dynamic(layers, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                         inplace=True)
    quantized = sum(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in layers.modules())
    if not quantized:
        raise RuntimeError("torch.ao.quantization.quantize_dynamic left no quantized Linear in the decoder "
                           "layers")
    return (f"torch.ao.quantization.quantize_dynamic: {quantized} Linear modules of the decoder layers, "
            f"qint8 per-channel weights, engine {torch.backends.quantized.engine}")


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


# -- GGUF files for llama.cpp -----------------------------------------------------------
def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order of a q or k projection: the inverse of
    decoders.checkpoints.gguf.unpermute_rope_rows (HF pairs rows i and i + head_dim/2 of a
    head, llama.cpp rows 2i and 2i+1)."""
    half = weight.shape[0] // n_heads // 2
    by_head = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return by_head.swapaxes(1, 2).reshape(weight.shape)


# amp -> (GGML type of the matrices llama.cpp runs, GGUF file type)
GGUF_KINDS = {"f32": ("F32", "ALL_F32"), "bf16": ("BF16", "MOSTLY_BF16"), "s8": ("Q8_0", "MOSTLY_Q8_0")}


def peer_gguf_path(source: pathlib.Path, amp: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Where llama.cpp's copy of `source` for `amp` lives: keyed by the source's path, size and mtime."""
    if cache_dir is None:
        from decoders.checkpoints.default_model import default_cache_dir

        cache_dir = default_cache_dir() / "dense"
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / f"{source.stem}-{key}.{_gguf_kind(amp)[0].lower()}.gguf"


def peer_gguf(source: str | os.PathLike, amp: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """A GGUF of the source's weights as our loader dequantizes them, for llama.cpp at `amp`
    (F32, BF16, or Q8_0 layer matrices for "s8"); written once, then found in the cache."""
    source = pathlib.Path(source)
    target = peer_gguf_path(source, amp, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        write_peer_gguf(source, pathlib.Path(partial), amp)
        os.replace(partial, target)
    except BaseException:
        pathlib.Path(partial).unlink(missing_ok=True)
        raise
    return target


def _gguf_kind(amp: str) -> tuple[str, str]:
    if amp not in GGUF_KINDS:
        raise ValueError(f"no GGUF for llama.cpp at amp {amp!r}; choose from {', '.join(GGUF_KINDS)}")
    return GGUF_KINDS[amp]


def stored_kind(gguf_name: str, shape: tuple[int, ...], amp: str):
    """The GGML type a tensor is written in for `amp`.

    f32: everything F32. bf16: every matrix BF16. s8: the matrices inside the blocks (the
    layers' linear weights, which pyhlo stores int8) Q8_0, the token embedding / LM head F32
    as pyhlo keeps them. Norms and other vectors stay F32, as llama.cpp's converter keeps
    them, and so does a matrix whose rows do not split into whole Q8_0 blocks.
    """
    import gguf

    kind = gguf.GGMLQuantizationType[_gguf_kind(amp)[0]]
    if len(shape) < 2 or kind == gguf.GGMLQuantizationType.F32:
        return gguf.GGMLQuantizationType.F32
    if kind == gguf.GGMLQuantizationType.Q8_0:
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if not gguf_name.startswith("blk.") or shape[-1] % block:
            return gguf.GGMLQuantizationType.F32
    return kind


def write_peer_gguf(source: pathlib.Path, target: pathlib.Path, amp: str) -> None:
    import gguf

    from decoders.checkpoints.gguf import ARCHITECTURES, GGUFCheckpoint

    file_type = gguf.LlamaFileType[_gguf_kind(amp)[1]]
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
    if file_type == gguf.LlamaFileType.MOSTLY_Q8_0:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

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
        kind = stored_kind(tensor.name, array.shape, amp)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.ascontiguousarray(array, dtype=np.float32))
        else:  # bytes of whole blocks per row; the writer reads the logical shape back from them
            writer.add_tensor(tensor.name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    checkpoint.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
