"""HF Llama checkpoints with random weights of a known shape, written once into the model cache.

A benchmark of speed needs the shape of a model, not its knowledge: random weights need no
download and no tokenizer, and every engine reads the same safetensors file. Each shape is
a row of data; the weights come from a fixed torch seed, so the same shape always gives the
same file::

    path = random_checkpoint("llama-3.2-1b")     # ~/.cache/pyhlo/models/random/llama-3.2-1b-<key>/
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)

# LlamaConfig arguments of each shape.
SHAPES: dict[str, dict] = {
    # Llama-3.2-1B: 1.24 B parameters, LM head tied to the embedding.
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE,
                         bos_token_id=128000, eos_token_id=128001),
    # SmolLM2-1.7B: 1.71 B parameters, LM head tied to the embedding, SmolLM2's vocabulary.
    "smollm2-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                         tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", rope_theta=130000.0),
                         bos_token_id=1, eos_token_id=2),
    # SmolLM2-135M: 135 M parameters (the default model's shape), for GGUF types its own file is not.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", rope_theta=100000.0),
                         bos_token_id=1, eos_token_id=2),
    # The same architecture in miniature, for tests: runs in seconds on a CPU.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=64)),
    # SmolLM2's architecture in miniature (plain rope, no KV-head grouping), for tests of GGUF files.
    "tiny-smollm2": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", rope_theta=130000.0)),
}
SEED = 0
DTYPE = "bfloat16"
# Random init gives near-uniform logits; larger matrices make greedy choices clear-cut, so
# engines that round differently still pick the same tokens.
MATRIX_SCALE = 4.0


def shape_key(shape: str) -> str:
    """A short hash of everything that decides the file's contents."""
    recipe = {"config": SHAPES[shape], "seed": SEED, "dtype": DTYPE, "scale": MATRIX_SCALE}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def random_checkpoint(shape: str, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The directory of the random `shape` checkpoint (config.json, model.safetensors), written
    the first time (atomically: a finished directory is renamed into place)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown random model {shape!r}; choose from {', '.join(SHAPES)}")
    if cache_dir is None:
        from decoders.checkpoints.default_model import default_cache_dir

        cache_dir = default_cache_dir() / "random"
    target = cache_dir / f"{shape}-{shape_key(shape)}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{target.name}."))
    try:
        write_random_llama(SHAPES[shape], partial)
        os.chmod(partial, 0o755)  # mkdtemp's folder is private; the cache's folders are readable
        try:
            os.rename(partial, target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def write_random_llama(config_args: dict, directory: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**config_args)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.mul_(MATRIX_SCALE)
    model.to(getattr(torch, DTYPE))
    model.generation_config.eos_token_id = None  # nothing ends a line of random tokens
    model.save_pretrained(directory, safe_serialization=True)
