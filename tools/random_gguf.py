"""A random checkpoint (tools/random_checkpoint.py) as a GGUF file of one weight type, written
once into the model cache, so pyhlo and llama.cpp can be measured on the same file at a size
people run::

    path = random_gguf("smollm2-1.7b", "q4_0")   # ~/.cache/pyhlo/models/random/smollm2-1.7b-<key>.q4_0.gguf

The file is laid out as llama.cpp's converter lays out a Llama: its tensor names, q/k rows
reordered for its rotary kernel, norms in F32, every matrix (the token embedding too) in the
chosen type. bf16, q8_0 and q4_0 are quantized with the `gguf` package; q4_k_m needs llama.cpp's
own quantizer (llama-cpp-python, the `.[llamacpp]` extra), run on the bf16 file. A shape whose
vocabulary is SmolLM2's carries SmolLM2's tokenizer (from the default model's file); any other
shape a tokenizer of type "none", which llama.cpp runs on token ids alone.
"""
from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from tools.random_checkpoint import SHAPES, random_checkpoint, shape_key

# GGUF type name -> (GGML type of the matrices, llama.cpp file type)
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_k_m": (None, "MOSTLY_Q4_K_M"),  # llama.cpp's quantizer decides each tensor's type
}
SMOLLM2_VOCAB = 49152


def plain_rope_shapes() -> list[str]:
    """The random shapes a GGUF file can hold as they are."""
    return [s for s, c in SHAPES.items() if c.get("rope_parameters", {}).get("rope_type") == "default"]


def random_gguf_path(shape: str, gguf_type: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown random model {shape!r}; choose from {', '.join(SHAPES)}")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose from {', '.join(GGUF_TYPES)}")
    if cache_dir is None:
        from decoders.checkpoints.default_model import default_cache_dir

        cache_dir = default_cache_dir() / "random"
    return cache_dir / f"{shape}-{shape_key(shape)}.{gguf_type}.gguf"


def random_gguf(shape: str, gguf_type: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The GGUF file of the random `shape` checkpoint in `gguf_type`, written the first time
    (into a temporary file renamed into place, so a killed run leaves no half file)."""
    target = random_gguf_path(shape, gguf_type, cache_dir)
    rope = SHAPES[shape].get("rope_parameters", {}).get("rope_type", "default")
    if rope != "default":
        raise ValueError(f"random model {shape!r} has {rope} rope scaling, which llama.cpp carries as a "
                         "rope_freqs tensor that pyhlo's GGUF loader does not read yet; choose a shape with "
                         f"plain rope ({', '.join(plain_rope_shapes())})")
    if target.is_file():
        return target
    if gguf_type == "q4_k_m":
        source = random_gguf(shape, "bf16", cache_dir)
        _write_atomically(target, lambda partial: _llama_cpp_quantize(source, partial, "MOSTLY_Q4_K_M"))
    else:
        hf_dir = random_checkpoint(shape, cache_dir)
        _write_atomically(target, lambda partial: write_llama_gguf(hf_dir, partial, gguf_type))
    return target


def _write_atomically(target: pathlib.Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        write(pathlib.Path(partial))
        os.chmod(partial, 0o644)  # mkstemp's file is private; the cache's files are readable
        os.replace(partial, target)
    except BaseException:
        pathlib.Path(partial).unlink(missing_ok=True)
        raise


def _llama_cpp_quantize(source: pathlib.Path, target: pathlib.Path, file_type: str) -> None:
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError("a Q4_K_M file is written by llama.cpp's own quantizer: install llama-cpp-python "
                           "(pip install -e '.[llamacpp]' in pyhlo's checkout)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{file_type}")
    params.nthread = os.cpu_count() or 1
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if failed:
        raise RuntimeError(f"llama.cpp's quantizer failed on {source} (code {failed})")


def _matrix_kind(name: str, shape: tuple[int, ...], gguf_type: str):
    """The GGML type one tensor is stored in: F32 for vectors and for a matrix whose rows do not
    split into whole blocks of the type, else the chosen type."""
    import gguf

    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    kind = gguf.GGMLQuantizationType[GGUF_TYPES[gguf_type][0]]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    return kind if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F32


def _gguf_names(config: dict) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, from the loader's own Llama mapping (inverted)."""
    from decoders.checkpoints.gguf import ARCHITECTURES

    arch = ARCHITECTURES["llama"]
    names = {f"{hf}.weight": f"{g}.weight" for g, hf in arch.global_tensors.items()}
    for layer in range(config["num_hidden_layers"]):
        for g, hf in arch.block_tensors.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{g}.weight"
    return names


def _add_metadata(writer, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if config["vocab_size"] == SMOLLM2_VOCAB:
        _copy_smollm2_tokenizer(writer)
    else:
        writer.add_tokenizer_model("none")


def _copy_smollm2_tokenizer(writer) -> None:
    import gguf

    from decoders.checkpoints.default_model import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)


def write_llama_gguf(hf_dir: pathlib.Path, target: pathlib.Path, gguf_type: str) -> None:
    """Write the Llama checkpoint in `hf_dir` (one model.safetensors) as a GGUF of `gguf_type`,
    one tensor at a time (memory bounded by the largest tensor, not the model)."""
    import json

    import gguf
    from safetensors import safe_open

    from tools.bench.peers import permute_rope_rows

    config = json.loads((hf_dir / "config.json").read_text())
    names = _gguf_names(config)
    writer = gguf.GGUFWriter(target, "llama")
    _add_metadata(writer, config)
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    with safe_open(hf_dir / "model.safetensors", framework="pt") as tensors:
        present = [n for n in names if n in tensors.keys()]
        kinds = {}
        for hf_name in present:
            shape = tuple(tensors.get_slice(hf_name).get_shape())
            kind = kinds[hf_name] = _matrix_kind(names[hf_name], shape, gguf_type)
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // block * block_bytes
            writer.add_tensor_info(names[hf_name], shape, np.dtype(np.float32), nbytes,
                                   raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for hf_name in present:
            array = tensors.get_tensor(hf_name).float().numpy()
            if ".self_attn.q_proj." in hf_name:
                array = permute_rope_rows(array, config["num_attention_heads"])
            elif ".self_attn.k_proj." in hf_name:
                array = permute_rope_rows(array, config["num_key_value_heads"])
            kind = kinds[hf_name]
            if kind == gguf.GGMLQuantizationType.F32:
                writer.write_tensor_data(np.ascontiguousarray(array, dtype=np.float32))
            else:
                writer.write_tensor_data(gguf.quants.quantize(array, kind))
    writer.close()
