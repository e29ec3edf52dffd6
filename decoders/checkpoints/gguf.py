"""Read a llama.cpp GGUF file as a checkpoint with Hugging Face names, config and tokenizer.

A GGUF file differs from a Hugging Face checkpoint in five ways, each undone here:

1. Tensor names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``.
2. Values: most weights are quantized in blocks (Q4_1, Q8_0 ...); ``get`` dequantizes them
   to float32 with ``gguf.quants.dequantize``.
3. Shapes: GGUF lists dimensions fastest-varying first, the reverse of numpy's order.
4. Rotary layout: llama.cpp's converter reorders the rows of the q and k projections
   of "llama" files (see ``unpermute_rope_rows``), not of "qwen2", "qwen3" or "phi3" ones.
5. Experts: a mixture of experts (Mixtral, written as "llama") stacks each expert weight
   into one tensor [n_expert, ...] (``blk.N.ffn_gate_exps``); it is read as one tensor per
   expert, with the names of HF's Mixtral checkpoints.
6. Gemma's norms: HF stores w - 1 and scales by 1 + w; llama.cpp's converter stores 1 + w,
   from which 1 is taken again on reading.

The config is rebuilt from the file's metadata with the keys Hugging Face's LlamaConfig uses.
Architectures are rows of ``ARCHITECTURES``; adding one is mostly adding data.
"""

from __future__ import annotations

import dataclasses
import mmap
import pathlib
from typing import Collection

import ml_dtypes
import numpy as np

from decoders.checkpoints.base import Checkpoint, CheckpointError
from decoders.weights.stored import BLOCK_FORMS, BlockWeight


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How one ``general.architecture`` maps onto a Hugging Face model."""

    model_type: str
    hf_architecture: str
    # GGUF tensor base name (without .weight/.bias) -> HF base name, outside the blocks.
    global_tensors: dict[str, str]
    # Per-block GGUF name -> HF name inside "model.layers.N.".
    block_tensors: dict[str, str]
    # HF config key -> metadata keys (after "<arch>.") to try in order.
    config_keys: dict[str, tuple[str, ...]]
    # HF config keys that must be found in the metadata.
    required_config: tuple[str, ...]
    # Fixed by the architecture, not stored in the file.
    config_defaults: dict
    # Block tensors whose rows llama.cpp reordered for its rotary kernel -> config key of their head count.
    rope_permuted: dict[str, str]
    # Tensors this loader knows but cannot honour yet -> why.
    unsupported_tensors: dict[str, str]
    # Per-block GGUF tensors stacked over experts [n_expert, ...] -> HF name ({e}: expert) in the block.
    expert_tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    # (model_type, HF architecture) of a file with expert tensors.
    moe_model: tuple[str, str] | None = None
    # Global tensors that are rotary settings, not weights (Phi-3's LongRoPE factors) -> their
    # key in HF's rope_parameters.
    rope_tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    # Added by llama.cpp's converter to every norm weight (Gemma's 1 + w); taken off on reading.
    norm_offset: float = 0.0
    # Gemma: the file stores no query_pre_attn_scalar; llama.cpp scales scores by 1/sqrt(head_dim),
    # or by 1/sqrt(hidden / heads) for the models of these block counts (the 27B ones). None: not Gemma.
    wide_query_scale_layers: tuple[int, ...] | None = None


LLAMA = GGUFArchitecture(
    model_type="llama",
    hf_architecture="LlamaForCausalLM",
    global_tensors={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    },
    block_tensors={
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "block_sparse_moe.gate",
    },
    config_keys={
        "hidden_size": ("embedding_length",),
        "intermediate_size": ("feed_forward_length",),
        "num_hidden_layers": ("block_count",),
        "num_attention_heads": ("attention.head_count",),
        "num_key_value_heads": ("attention.head_count_kv", "attention.head_count"),
        "head_dim": ("attention.key_length", "rope.dimension_count"),
        "rms_norm_eps": ("attention.layer_norm_rms_epsilon",),
        "rope_theta": ("rope.freq_base",),
        "max_position_embeddings": ("context_length",),
        "num_local_experts": ("expert_count",),
        "num_experts_per_tok": ("expert_used_count",),
    },
    required_config=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "rms_norm_eps",
    ),
    config_defaults={"hidden_act": "silu", "rope_theta": 10000.0, "max_position_embeddings": 2048},
    rope_permuted={"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"},
    unsupported_tensors={
        "rope_freqs": "per-dimension RoPE frequency factors (Llama 3.1-style rope scaling baked "
        "into a tensor) are not supported yet",
    },
    # llama.cpp's converter writes Mixtral's experts w1 (gate), w3 (up) and w2 (down) stacked.
    expert_tensors={
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    },
    moe_model=("mixtral", "MixtralForCausalLM"),
)

# Qwen2's converter keeps HF's q and k rows as they are, and writes q, k, v biases.
QWEN2 = dataclasses.replace(
    LLAMA,
    model_type="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    block_tensors={k: v for k, v in LLAMA.block_tensors.items() if k != "ffn_gate_inp"},
    rope_permuted={},
    expert_tensors={},
    moe_model=None,
)

# Qwen3: Qwen2's names (without biases unless the file has them) and the per-head q and k norms.
QWEN3 = dataclasses.replace(
    QWEN2,
    model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    block_tensors={**QWEN2.block_tensors, "attn_q_norm": "self_attn.q_norm",
                   "attn_k_norm": "self_attn.k_norm"},
)

# Qwen3-MoE: Qwen3's attention, experts stacked as Mixtral's are; llama.cpp always renormalises
# the chosen experts' weights for this architecture (norm_topk_prob).
QWEN3_MOE = dataclasses.replace(
    QWEN3,
    model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    block_tensors={**QWEN3.block_tensors, "ffn_gate_inp": "mlp.gate"},
    config_keys={**QWEN3.config_keys, "moe_intermediate_size": ("expert_feed_forward_length",)},
    config_defaults={**QWEN3.config_defaults, "norm_topk_prob": True},
    expert_tensors={
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    },
    moe_model=("qwen3_moe", "Qwen3MoeForCausalLM"),
)

# Phi-3 / Phi-4: fused qkv and gate|up projections kept fused (ffn_up has the gate's rows then
# the up's); rope.dimension_count is the rotary part of a head, not the head; LongRoPE's factors
# are two global tensors.
PHI3 = dataclasses.replace(
    LLAMA,
    model_type="phi3",
    hf_architecture="Phi3ForCausalLM",
    block_tensors={
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    config_keys={**{k: v for k, v in LLAMA.config_keys.items() if k not in ("num_local_experts",
                                                                            "num_experts_per_tok")},
                 "head_dim": ("attention.key_length",),
                 "sliding_window": ("attention.sliding_window",)},
    config_defaults={**LLAMA.config_defaults, "max_position_embeddings": 4096},
    rope_permuted={},
    unsupported_tensors={},
    expert_tensors={},
    moe_model=None,
    rope_tensors={"rope_factors_long": "long_factor", "rope_factors_short": "short_factor"},
)

GEMMA_BLOCKS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA_CONFIG = {
    **{k: v for k, v in LLAMA.config_keys.items() if k not in ("num_local_experts", "num_experts_per_tok")},
    "sliding_window": ("attention.sliding_window",),
    "sliding_window_pattern": ("attention.sliding_window_pattern",),
    "final_logit_softcapping": ("final_logit_softcapping",),
}
# Gemma 2 and 3: q and k rows as HF has them (no rotary reordering), tied LM head, norms stored 1 + w.
GEMMA2 = GGUFArchitecture(
    model_type="gemma2",
    hf_architecture="Gemma2ForCausalLM",
    global_tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    block_tensors=GEMMA_BLOCKS,
    config_keys={**GEMMA_CONFIG, "attn_logit_softcapping": ("attn_logit_softcapping",)},
    required_config=LLAMA.required_config,
    config_defaults={"hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0,
                     "max_position_embeddings": 8192},
    rope_permuted={},
    unsupported_tensors={},
    norm_offset=1.0,
    wide_query_scale_layers=(46,),
)
# llama.cpp runs Gemma 3's sliding-window layers at rotary base 10 000, five to each global layer,
# unless the file says otherwise (rope.freq_base_swa, attention.sliding_window_pattern).
GEMMA3 = dataclasses.replace(
    GEMMA2,
    model_type="gemma3_text",
    hf_architecture="Gemma3ForCausalLM",
    block_tensors={**GEMMA_BLOCKS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    config_keys={**GEMMA_CONFIG, "rope_local_base_freq": ("rope.freq_base_swa",)},
    config_defaults={"hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1_000_000.0,
                     "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
                     "max_position_embeddings": 131072},
    wide_query_scale_layers=(62,),
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3,
                                              "qwen3moe": QWEN3_MOE, "phi3": PHI3, "gemma2": GEMMA2,
                                              "gemma3": GEMMA3}

# tokenizer.ggml.<key> -> HF config key
TOKEN_ID_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
    "unknown_token_id": "unk_token_id",
}


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a q or k projection (weight or bias), head by head.

    Hugging Face's rotary embedding pairs row ``i`` of a head with row ``i + head_dim/2``;
    llama.cpp's kernel pairs adjacent rows ``2i`` and ``2i+1``, so its converter stores, within
    each head, row ``j * head_dim/2 + i`` of the HF weight at row ``2i + j``. Reading the head
    as ``[head_dim/2, 2]`` and transposing to ``[2, head_dim/2]`` restores the HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"cannot split {rows} rows into {n_heads} rotary heads of even size")
    half = rows // n_heads // 2
    by_head = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return by_head.swapaxes(1, 2).reshape(weight.shape)


# Arrays longer than this (the vocabulary, its merges and scores) are not kept once the file is
# open: as parsed they take far more memory than the weights of a small model.
LONG_ARRAY = 1024
# GGML types run as stored, by the name of their block form (decoders/weights/stored.py).
FORM_OF_TYPE = {form.ggml_type: name for name, form in BLOCK_FORMS.items()}
# Quantized tensors are dequantized this many values at a time, to bound the temporaries.
DEQUANTIZE_CHUNK = 1 << 22


def _read_metadata(reader) -> tuple[dict, dict]:
    """Values of the metadata fields by key, and the lengths of the long arrays left out."""
    import gguf

    values, long_arrays = {}, {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > LONG_ARRAY:
            long_arrays[key] = len(field.data)
        else:
            values[key] = field.contents()
    return values, long_arrays


def _dequantize(data: np.ndarray, kind, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    blocks = data.reshape(-1, data.shape[-1])  # one row of blocks per row of the tensor
    out = np.empty((blocks.shape[0], shape[-1]), np.float32)
    step = max(1, DEQUANTIZE_CHUNK // shape[-1])
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = gguf.quants.dequantize(blocks[start : start + step], kind)
    return out.reshape(shape)


class GGUFCheckpoint(Checkpoint):
    """A .gguf file, read lazily: each ``get`` dequantizes one tensor."""

    def __init__(self, path: str | pathlib.Path):
        import gguf

        self.path = pathlib.Path(path)
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self._metadata, self._long_arrays = _read_metadata(reader)
        self._mapping = getattr(reader.data, "_mmap", None)      # numpy.memmap's mmap.mmap
        arch_name = self._metadata.get("general.architecture")
        self.arch = ARCHITECTURES.get(arch_name)
        if self.arch is None:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {arch_name!r} is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        self._arch_name = arch_name
        # HF name -> (GGUF tensor, config key of its rotary head count or None, expert index or None)
        self._tensors = {}
        # rope_parameters key -> its values, from the architecture's rope_tensors
        self._rope_tensors = {}
        for tensor in reader.tensors:
            base = tensor.name.rpartition(".")[0]
            if base in self.arch.rope_tensors:
                self._rope_tensors[self.arch.rope_tensors[base]] = [float(f) for f in np.asarray(tensor.data)]
                continue
            for hf_name, rope_heads, expert in self._hf_names(tensor):
                self._tensors[hf_name] = (tensor, rope_heads, expert)
        self.config = self._config()

    def _hf_names(self, tensor) -> list[tuple[str, str | None, int | None]]:
        """The HF names a GGUF tensor is read as: one, or one per expert of a stacked tensor."""
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        if (len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
                and parts[2] in self.arch.expert_tensors):
            template = f"model.layers.{parts[1]}.{self.arch.expert_tensors[parts[2]]}.{suffix}"
            n_experts = int(tensor.shape[-1])   # GGUF lists dimensions fastest first
            return [(template.format(e=e), None, e) for e in range(n_experts)]
        return [(*self._hf_name(tensor.name), None)]

    def _hf_name(self, gguf_name: str) -> tuple[str, str | None]:
        arch = self.arch
        base, _, suffix = gguf_name.rpartition(".")
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            key, prefix = parts[2], f"model.layers.{parts[1]}."
            table = arch.block_tensors
        else:
            key, prefix = base, ""
            table = arch.global_tensors
        if key in arch.unsupported_tensors:
            raise CheckpointError(f"{self.path}: tensor {gguf_name}: {arch.unsupported_tensors[key]}")
        if key not in table or suffix not in ("weight", "bias"):
            raise CheckpointError(
                f"{self.path}: tensor {gguf_name!r} has no known Hugging Face name for GGUF "
                f"architecture {self._arch_name!r}; known: "
                f"{', '.join(sorted(arch.global_tensors))}, "
                f"blk.N.{{{','.join(sorted([*arch.block_tensors, *arch.expert_tensors]))}}}"
            )
        rope_heads = arch.rope_permuted.get(key) if table is arch.block_tensors else None
        return f"{prefix}{table[key]}.{suffix}", rope_heads

    def _config(self) -> dict:
        arch = self.arch
        config = {"model_type": arch.model_type, "architectures": [arch.hf_architecture]}
        config.update(arch.config_defaults)
        for hf_key, gguf_keys in arch.config_keys.items():
            for key in gguf_keys:
                value = self._metadata.get(f"{self._arch_name}.{key}")
                if value is not None:
                    config[hf_key] = value
                    break
            else:
                if hf_key in arch.required_config:
                    keys = " or ".join(f"{self._arch_name}.{k}" for k in gguf_keys)
                    raise CheckpointError(f"{self.path}: metadata {keys} is missing (needed for {hf_key})")
        self._expert_config(config)
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        for key in ("rms_norm_eps", "rope_theta"):
            config[key] = float(config[key])

        config["vocab_size"] = (
            self._long_arrays.get("tokenizer.ggml.tokens")
            or len(self._metadata.get("tokenizer.ggml.tokens", ()))
            or self._metadata.get(f"{self._arch_name}.vocab_size")
            or self.shape("model.embed_tokens.weight")[0]
        )
        config["tie_word_embeddings"] = "lm_head.weight" not in self._tensors
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        config["mlp_bias"] = "model.layers.0.mlp.gate_proj.bias" in self._tensors
        for gguf_key, hf_key in TOKEN_ID_KEYS.items():
            value = self._metadata.get(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                config[hf_key] = int(value)

        if not config.get("sliding_window"):
            config.pop("sliding_window", None)     # llama.cpp writes 0 for none
        self._gemma_config(config)
        config["rope_scaling"] = self._rope_scaling()
        # transformers 5 keeps theta and scaling together under one key.
        config["rope_parameters"] = {
            "rope_type": "default",
            **(config["rope_scaling"] or {}),
            "rope_theta": config["rope_theta"],
        }
        rotary = self._metadata.get(f"{self._arch_name}.rope.dimension_count")
        if rotary is not None and int(rotary) != config["head_dim"]:
            config["rope_parameters"]["partial_rotary_factor"] = int(rotary) / config["head_dim"]
        return config

    def _gemma_config(self, config: dict) -> None:
        """Gemma's attention scale as llama.cpp takes it, and a sliding-window pattern stored as
        one flag per layer (true: a sliding-window layer) as HF's layer_types."""
        if self.arch.wide_query_scale_layers is None:
            return
        wide = config["num_hidden_layers"] in self.arch.wide_query_scale_layers
        config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if wide
                                           else config["head_dim"])
        pattern = config.get("sliding_window_pattern")
        if isinstance(pattern, list):
            del config["sliding_window_pattern"]
            config["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]

    def _expert_config(self, config: dict) -> None:
        """A file with stacked expert tensors is a mixture of experts: its model type, and the
        expert counts it must state."""
        stacked = {int(tensor.shape[-1]) for tensor, _, expert in self._tensors.values()
                   if expert is not None}
        if not stacked:
            for key in ("num_local_experts", "num_experts_per_tok"):
                config.pop(key, None)
            return
        config["model_type"], architecture = self.arch.moe_model
        config["architectures"] = [architecture]
        for key, gguf_key in (("num_local_experts", "expert_count"),
                              ("num_experts_per_tok", "expert_used_count")):
            if key not in config:
                raise CheckpointError(f"{self.path}: metadata {self._arch_name}.{gguf_key} is missing "
                                      f"(needed for {key} of a mixture of experts)")
        if stacked != {config["num_local_experts"]}:
            raise CheckpointError(f"{self.path}: expert tensors stack {sorted(stacked)} experts, "
                                  f"the metadata says {config['num_local_experts']}")

    def _rope_scaling(self) -> dict | None:
        prefix = f"{self._arch_name}.rope.scaling."
        kind = self._metadata.get(prefix + "type")
        if self._rope_tensors:
            # LongRoPE's factors as tensors (llama.cpp's Phi-3), its attention factor as metadata.
            if set(self._rope_tensors) != set(self.arch.rope_tensors.values()):
                raise CheckpointError(f"{self.path}: LongRoPE needs both tensors "
                                      f"{' and '.join(self.arch.rope_tensors)}; the file has one")
            kind = "longrope"
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, **self._rope_tensors}
        attention_factor = self._metadata.get(prefix + "attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        factor = self._metadata.get(prefix + "factor")
        if factor is not None:
            scaling["factor"] = float(factor)
        original = self._metadata.get(prefix + "original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def _open_tensors(self) -> dict:
        if self._tensors is None:
            raise CheckpointError(f"{self.path}: checkpoint is closed; open it again")
        return self._tensors

    def names(self) -> list[str]:
        return list(self._open_tensors())

    def __contains__(self, name: str) -> bool:
        return name in self._open_tensors()

    def shape(self, name: str) -> tuple[int, ...]:
        self._require(name)
        tensor, _, expert = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return shape if expert is None else shape[1:]

    def quant_type(self, name: str) -> str:
        """The stored GGML type of a tensor, e.g. ``"Q4_1"``."""
        self._require(name)
        return self._tensors[name][0].tensor_type.name

    def block_form(self, name: str) -> str | None:
        self._require(name)
        return FORM_OF_TYPE.get(self.quant_type(name))

    def blocks(self, name: str) -> BlockWeight:
        """A tensor stored in a block form pyhlo runs as stored, bit for bit, rows in Hugging
        Face's order: Q8_0, Q4_0, Q4_1 split into values, scales (and minimums); the other forms
        as the file's bytes (BLOCK_FORMS)."""
        form = self.block_form(name)
        if form is None:
            raise CheckpointError(f"{self.path}: {name} is stored {self.quant_type(name)}, not in a block "
                                  f"form pyhlo runs as stored ({', '.join(FORM_OF_TYPE)})")
        tensor, rope_heads, expert = self._tensors[name]
        data = tensor.data if expert is None else tensor.data[expert]
        rows, layout = self.shape(name)[0], BLOCK_FORMS[form]
        if layout.as_file:
            weight = BlockWeight(form, np.array(data).reshape(rows, -1))
        else:
            blocks = np.asarray(data).reshape(rows, -1, layout.block_bytes)
            # Each block: an f16 scale, an f16 minimum where the form has one, then the values.
            halves = 2 if layout.has_mins else 1
            parts = [np.ascontiguousarray(blocks[:, :, 2 * i:2 * i + 2]).view(np.float16)[:, :, 0]
                     for i in range(halves)]
            values = np.ascontiguousarray(blocks[:, :, 2 * halves:]).reshape(rows, -1)
            if form == "q8_0":
                values = values.view(np.int8)
            weight = BlockWeight(form, values, *parts)
        if rope_heads is not None:
            weight = BlockWeight(form, *(None if a is None
                                         else unpermute_rope_rows(a, self.config[rope_heads])
                                         for a in weight[1:]))
        return weight

    def _read(self, name: str) -> np.ndarray:
        import gguf

        shape = self.shape(name)
        tensor, rope_heads, expert = self._tensors[name]
        kind = tensor.tensor_type
        # One expert of a stacked tensor: its rows only, never the whole stack.
        data = tensor.data if expert is None else tensor.data[expert]
        if kind == gguf.GGMLQuantizationType.BF16:
            array = data.view(np.uint16).view(ml_dtypes.bfloat16).reshape(shape).copy()
        elif data.dtype != np.uint8:
            # Stored unquantized (F32, F16, F64, I8 ... I64): copy it out of the file mapping.
            array = np.array(data).reshape(shape)
        else:
            array = _dequantize(data, kind, shape)
        if rope_heads is not None:
            array = unpermute_rope_rows(array, self.config[rope_heads])
        if self.arch.norm_offset and name.endswith("norm.weight"):
            array = array.astype(np.float32) - np.float32(self.arch.norm_offset)
        return array

    def tokenizer(self):
        if "tokenizer.ggml.tokens" not in self._long_arrays and "tokenizer.ggml.tokens" not in self._metadata:
            raise CheckpointError(f"{self.path}: this GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
        from transformers import AutoTokenizer

        # Building a tokenizer from GGUF metadata takes seconds; keep the converted one.
        cached = tokenizer_cache_dir(self.path)
        tokenizer = load_cached_tokenizer(self.path)
        if tokenizer is not None:
            return tokenizer
        import logging

        logging.getLogger("pyhlo.progress").info("building the tokenizer from %s (once, up to a minute) ...",
                                                 self.path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        if cached is not None:
            self._save_tokenizer(tokenizer, cached)
        return tokenizer

    @staticmethod
    def _save_tokenizer(tokenizer, directory: pathlib.Path) -> None:
        import shutil
        import tempfile

        staging = None
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            staging = pathlib.Path(tempfile.mkdtemp(dir=directory.parent))
            tokenizer.save_pretrained(str(staging))
            staging.replace(directory)
        except OSError:
            if staging is not None:  # another process won the race, or no space
                shutil.rmtree(staging, ignore_errors=True)

    def chat_template(self) -> str | None:
        return self._metadata.get("tokenizer.chat_template")

    def metadata(self, key: str, default=None):
        """A GGUF metadata value, e.g. ``metadata("general.name")``; vocabulary-sized arrays
        are not kept (the tokenizer reads them from the file)."""
        return self._metadata.get(key, default)

    def release_pages(self, kept: Collection[int] = ()) -> None:
        # Arrays returned own their memory (none is kept). A read-only shared mapping: its
        # pages stay in the page cache, a later read maps them again.
        if self._mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        # Drop the file mapping; arrays already returned own their memory.
        self._tensors = None
        self._mapping = None


def _cache_key(path: pathlib.Path) -> str:
    import hashlib

    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def tokenizer_cache_dir(path: pathlib.Path) -> pathlib.Path | None:
    """Where the tokenizer built from this GGUF file is kept (PYHLO_TOKENIZER_CACHE=0: nowhere)."""
    import os

    root = os.environ.get("PYHLO_TOKENIZER_CACHE",
                          str(pathlib.Path.home() / ".cache" / "pyhlo" / "tokenizers"))
    if root in ("", "0"):
        return None
    return pathlib.Path(root) / f"{path.stem}-{_cache_key(path)}"


def load_cached_tokenizer(path: pathlib.Path):
    """The tokenizer kept for this GGUF file, or None."""
    cached = tokenizer_cache_dir(path)
    if cached is None or not (cached / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(cached))
    except (OSError, ValueError):
        return None
