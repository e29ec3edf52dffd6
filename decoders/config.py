"""Configuration: NeuronConfig (how programs are built), QuantizationConfig (its weights'
quantization) and GenerationConfig (sampling).

Names follow transformers-neuronx so its users' code ports by changing an import.
Every field is validated at construction; an option that is not built yet raises
NotSupportedYet instead of being silently ignored.
"""
from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass, field
from typing import Any

from pyhlo.dtypes import element_type_of_amp
from pyhlo.scribe import DOT_PRECISIONS


class NotSupportedYet(ValueError):
    """A transformers-neuronx option pyhlo recognises but has not built yet."""


# NeuronConfig.f32_matmul_precision: XLA's dot precisions, and "tf32" (XLA's "default").
F32_MATMUL_PRECISIONS = (*DOT_PRECISIONS, "tf32")
# NeuronConfig.kv_cache_dtype: the amp type (None), or caches of f32 or bf16 whatever the amp.
KV_CACHE_DTYPES = (None, "f32", "bf16")

class GQA(enum.Enum):
    """How tensor parallelism shares out the KV heads of grouped-query attention
    (transformers-neuronx's names and string values). With tp_degree 1 every strategy is the
    same: one device holds all heads."""

    # Whole KV heads split over the devices, each with its query heads: needs n_kv_heads to
    # be a multiple of tp_degree (no replication, no padding).
    SHARD_OVER_HEADS = "shard-over-heads"
    # The caches split by batch line: every device projects all KV heads (the K and V weights
    # replicated) and keeps its lines; query heads and attention outputs change hands (heads
    # for lines and back). Needs batch_size and n_heads to be multiples of tp_degree.
    SHARD_OVER_BATCH = "shard-over-batch"
    # Every device holds the KV heads its query heads need: split where they divide, replicated
    # when fewer than the devices, else padded with zero heads (what None chooses too).
    REPLICATED_HEADS = "replicated-heads"
    # K and V split evenly by features (heads cut across devices), gathered after the product
    # (an all-gather per layer); each device caches the KV heads of its query heads. Needs
    # n_heads to be a multiple of tp_degree, and a device's query heads to hold whole KV
    # groups or to sit inside one.
    ALL_GATHER_HEADS = "all-gather-heads"


def _not_yet(name: str, value: Any, hint: str = "") -> NotSupportedYet:
    return NotSupportedYet(f"NeuronConfig.{name}={value!r} is not supported yet{hint}")


@dataclass
class GenerationConfig:
    """Sampling parameters used on the device (transformers-neuronx's GenerationConfig).

    max_length: as transformers-neuronx, sample() stops each line at max_length tokens (the
    padded prompt width and the new tokens), or at its sequence_length if that is smaller.

    top_k=0 means no top-k filter; global_top_k bounds the candidates considered on
    the device (None: the whole vocabulary when needed), and every top_k must fit in it.
    With per_batch_line=True, top_k, top_p and temperature may be lists with one value
    per batch line (a single value is used for every line). Settings are inputs of the
    compiled sampler (dynamic=True): model.update_generation_config() changes them for
    later sample() calls without compiling anything.
    """

    max_length: int | None = None
    do_sample: bool = False
    top_k: int | list[int] = 50
    top_p: float | list[float] = 1.0
    top_p_min_tokens: int | list[int] = 1
    temperature: float | list[float] = 1.0
    dynamic: bool = True
    deterministic: bool = False
    per_batch_line: bool = False
    global_top_k: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.max_length is not None and (isinstance(self.max_length, bool)
                                            or not isinstance(self.max_length, numbers.Integral)
                                            or self.max_length < 1):
            raise ValueError(f"GenerationConfig.max_length must be None or an int >= 1 (prompt and new "
                             f"tokens of a line), got {self.max_length!r}")
        for name in ("top_k", "top_p", "temperature", "top_p_min_tokens"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                if not self.per_batch_line:
                    raise ValueError(f"GenerationConfig.{name} is a list: one value per batch line needs "
                                     "per_batch_line=True")
                if not value:
                    raise ValueError(f"GenerationConfig.{name} is an empty list: give one value per batch "
                                     "line")
                setattr(self, name, list(value))
        for k in self.values("top_k"):
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
                raise ValueError(f"GenerationConfig.top_k must be an int >= 0 (0 = off), got {k!r}")
        for p in self.values("top_p"):
            if not 0.0 < float(p) <= 1.0:
                raise ValueError(f"GenerationConfig.top_p must be in (0, 1], got {p}")
        for t in self.values("temperature"):
            if not float(t) > 0.0:
                raise ValueError(f"GenerationConfig.temperature must be > 0, got {t}")
        for name, kind in (("top_k", int), ("top_p", float), ("temperature", float)):
            value = getattr(self, name)
            setattr(self, name, [kind(v) for v in value] if isinstance(value, list) else kind(value))
        if any(m != 1 for m in self.values("top_p_min_tokens")):
            raise NotSupportedYet("GenerationConfig.top_p_min_tokens other than 1 is not supported yet")
        if self.global_top_k is not None:
            if (isinstance(self.global_top_k, bool) or not isinstance(self.global_top_k, int)
                    or self.global_top_k < 1):
                raise ValueError("GenerationConfig.global_top_k must be an int >= 1, got "
                                 f"{self.global_top_k!r}")
            over = [k for k in self.values("top_k") if k > self.global_top_k]
            if over:
                raise ValueError(f"GenerationConfig.top_k {max(over)} exceeds global_top_k "
                                 f"{self.global_top_k}: global_top_k bounds the candidates every line draws "
                                 "from")

    def values(self, name: str) -> list:
        """The setting `name` as a list (one value, or one per batch line)."""
        value = getattr(self, name)
        return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class ContinuousBatchingConfig:
    """transformers-neuronx's continuous batching: the KV caches hold this many sequences, one
    per batch line, each at its own length; new sequences are prefilled into free lines while
    the others keep decoding (forward(input_ids, cache_ids, start_ids=seq_ids))."""

    batch_size_for_shared_caches: int

    def __post_init__(self) -> None:
        size = self.batch_size_for_shared_caches
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError("ContinuousBatchingConfig.batch_size_for_shared_caches must be an int >= 1, "
                             f"got {size!r}")


# QuantizationConfig: transformers-neuronx calls per-output-channel symmetric scaling "vector_dynamic".
QUANT_METHODS = ("vector_dynamic", "per_channel_symmetric")
QUANT_DTYPES = ("s8",)


@dataclass
class QuantizationConfig:
    """How weights are quantized (transformers-neuronx's names), e.g.
    NeuronConfig(quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16")).

    Every linear weight inside the decoder layers (attention and MLP products, experts and
    routers included; not the embedding or the LM head) is stored as int8 [out, in] with one
    f32 scale per output row, symmetric: w ~= scale[o] * q[o, i], scale[o] = max_i |w[o, i]| / 127.
    A product computes (x @ q.T) * scale: XLA converts q to `dequant_dtype` inside the program
    (plain HLO, any backend), pyhlo's CPU kernel widens it in registers.

    quant_dtype: the stored type ("s8"). dequant_dtype: the type products run in after
    dequantizing; None: the model's amp type (anything else must equal it). quantize_method:
    "vector_dynamic" or its plain name "per_channel_symmetric". quantize_attn: False keeps the
    attention products unquantized. no_quantize_list: parameter names (as `pyhlo inspect`
    lists them, e.g. "mlp.down.weight") kept unquantized.
    """

    quant_dtype: str = "s8"
    dequant_dtype: str | None = None
    quantize_method: str = "vector_dynamic"
    quantize_attn: bool = True
    no_quantize_list: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant_dtype not in QUANT_DTYPES:
            raise ValueError(f"QuantizationConfig.quant_dtype must be one of {QUANT_DTYPES}, got "
                             f"{self.quant_dtype!r}")
        if self.quantize_method not in QUANT_METHODS:
            raise ValueError(f"QuantizationConfig.quantize_method must be one of {QUANT_METHODS}, got "
                             f"{self.quantize_method!r}")
        if self.dequant_dtype is not None:
            self.dequant_dtype = element_type_of_amp(self.dequant_dtype)
        self.no_quantize_list = list(self.no_quantize_list)

    def check_amp(self, amp: str) -> None:
        """A ValueError when dequant_dtype is set and is not the model's amp type."""
        if self.dequant_dtype is not None and self.dequant_dtype != amp:
            raise ValueError(f"QuantizationConfig.dequant_dtype={self.dequant_dtype!r} does not match "
                             f"amp={amp!r}: products run in the amp type; set dequant_dtype={amp!r} or "
                             "leave it None")

    def quantizes(self, name: str) -> bool:
        """Whether the layer parameter `name` (a linear weight) is stored quantized."""
        if name in self.no_quantize_list:
            return False
        return self.quantize_attn or not name.startswith("attn.")

    def to_dict(self) -> dict:
        return {"quant_dtype": self.quant_dtype, "dequant_dtype": self.dequant_dtype,
                "quantize_method": self.quantize_method, "quantize_attn": self.quantize_attn,
                "no_quantize_list": list(self.no_quantize_list)}


@dataclass
class NeuronConfig:
    """How the programs are built. Defaults are what pyhlo builds today."""

    fuse_qkv: bool = True
    attention_layout: str = "BSH"
    # A GQA (or its string value); None: GQA.REPLICATED_HEADS's choice.
    group_query_attention: GQA | str | None = None
    # Weight quantization: a decoders.QuantizationConfig (int8 per-channel), or None.
    quant: Any = None
    # GGUF weights stored in a block form pyhlo keeps (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K to
    # Q6_K, IQ4_NL, IQ4_XS: decoders/weights/stored.py) run in their blocks as stored
    # (dequantized in the product). None: where they can (tp_degree 1, no `quant`); True:
    # insist; False: widen them to the amp type at load.
    gguf_blocks: bool | None = None
    # KV caches quantized to int8 (NxD Inference's kv_cache_quant): each slot's key and value
    # of each KV head stored as head_dim int8 values and an f32 scale (max |x| / 127), about
    # a quarter of f32 caches' bytes and half of bf16's. True is "s8"; False keeps the amp type.
    kv_cache_quant: bool | str = False
    # The KV caches' element type when it differs from the amp type: "bf16" keeps an f32
    # model's keys and values in half the bytes (llama.cpp's caches are f16 by default; vLLM's
    # kv_cache_dtype). None: the amp type.
    kv_cache_dtype: str | None = None
    # Products of GGUF block weights on pyhlo's CPU kernels (decode steps, the LM head) round
    # the activations to int8 as llama.cpp does and multiply integers: faster, within the
    # rounding of the exact product (off: activations stay f32). Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and
    # IQ4_NL round per 32 values (max |x| / 127), the K-quants Q2_K to Q6_K and IQ4_XS per 256
    # (llama.cpp's Q8_K); rows of mixed forms each way their forms take. With int8 weights
    # (`quant`), a prompt's products (more activation rows than the matrix-vector kernel takes)
    # round per 32 values and run on the int8 GEMM, as HF's dynamic int8 Linear rounds its
    # inputs; decode steps, bound by reading the weights, keep f32 activations.
    int8_activations: bool = False
    on_device_generation: GenerationConfig | None = None
    # The token embedding runs inside the device program (transformers-neuronx's
    # on_device_embedding=True): pyhlo's programs always start from token ids.
    on_device_embedding: bool = True
    padding_side: str = "right"
    output_all_logits: bool = False
    # A ContinuousBatchingConfig: one sequence per batch line, each at its own length.
    continuous_batching: ContinuousBatchingConfig | None = None
    cast_logits_dtype: str = "f32"
    # Flash decoding: the KV cache split along the sequence over the tp_degree devices.
    shard_over_sequence: bool = False
    compilation_worker_count: int | None = None
    # Decode steps as one unrolled program per bucket (True) or as embed, one decoder-block
    # program reused by every layer, and LM head (False). None: unrolled where that is
    # faster (XLA:CPU with pyhlo's CPU kernels). Prefill always runs per block.
    whole_model_program: bool | None = None
    weight_layout: str | None = None
    cpu_kernels: bool | None = None
    # How exactly f32 matrix products are computed: "highest" (the default) is true f32 on
    # every platform; "tf32" (or XLA's "default") lets an NVIDIA GPU round the operands to
    # TF32 for speed, as torch.backends.cuda.matmul.allow_tf32 does; "high" is XLA's middle
    # setting. bf16 and f16 models are unaffected.
    f32_matmul_precision: str = "highest"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fuse_qkv, bool):
            raise ValueError(f"NeuronConfig.fuse_qkv must be a bool, got {self.fuse_qkv!r}")
        if self.attention_layout != "BSH":
            raise _not_yet("attention_layout", self.attention_layout, "; use 'BSH'")
        if self.group_query_attention is not None:
            try:
                self.group_query_attention = GQA(self.group_query_attention)
            except ValueError:
                raise ValueError(f"NeuronConfig.group_query_attention must be None or one of "
                                 f"{[g.value for g in GQA]}, got {self.group_query_attention!r}") from None
        if isinstance(self.quant, dict):
            self.quant = QuantizationConfig(**self.quant)
        if self.quant is not None and not isinstance(self.quant, QuantizationConfig):
            raise ValueError(f"NeuronConfig.quant must be None or a QuantizationConfig (e.g. "
                             f"QuantizationConfig(quant_dtype='s8')), got {self.quant!r}")
        if self.on_device_generation is not None:
            self._check_generation(self.on_device_generation)
        if self.on_device_embedding not in (True, False):
            raise ValueError(f"NeuronConfig.on_device_embedding must be True or False, "
                             f"got {self.on_device_embedding!r}")
        if not self.on_device_embedding:
            raise _not_yet("on_device_embedding", False, "; the programs take token ids and look up the "
                           "embedding on the device (embedding on the host is not built)")
        if self.padding_side not in ("left", "right"):
            raise ValueError("NeuronConfig.padding_side must be 'left' or 'right', got "
                             f"{self.padding_side!r}")
        if self.padding_side == "left":
            raise _not_yet("padding_side", "left", "; a prompt shorter than its context bucket is padded "
                           "on the right")
        if self.output_all_logits:
            raise _not_yet("output_all_logits", True)
        if isinstance(self.continuous_batching, dict):
            self.continuous_batching = ContinuousBatchingConfig(**self.continuous_batching)
        if self.continuous_batching is not None:
            if not isinstance(self.continuous_batching, ContinuousBatchingConfig):
                raise ValueError("NeuronConfig.continuous_batching must be None or a "
                                 f"ContinuousBatchingConfig, got {self.continuous_batching!r}")
            if self.shard_over_sequence:
                raise _not_yet("shard_over_sequence", True, " with continuous_batching")
        if self.cast_logits_dtype not in ("f32", "float32"):
            raise _not_yet("cast_logits_dtype", self.cast_logits_dtype, "; logits are f32")
        if self.compilation_worker_count is not None and self.compilation_worker_count < 1:
            raise ValueError("NeuronConfig.compilation_worker_count must be >= 1")
        if self.weight_layout not in (None, "in_out", "out_in"):
            raise ValueError("NeuronConfig.weight_layout must be None, 'in_out' or 'out_in', got "
                             f"{self.weight_layout!r}")
        if self.whole_model_program not in (None, True, False):
            raise ValueError(f"NeuronConfig.whole_model_program must be None, True or False, "
                             f"got {self.whole_model_program!r}")
        if self.gguf_blocks not in (None, True, False):
            raise ValueError("NeuronConfig.gguf_blocks must be None, True or False, got "
                             f"{self.gguf_blocks!r}")
        if self.gguf_blocks and self.quant is not None:
            raise ValueError("NeuronConfig.gguf_blocks=True keeps a GGUF file's own quantization; it cannot "
                             "be combined with quant (drop one of them)")
        if self.int8_activations not in (True, False):
            raise ValueError("NeuronConfig.int8_activations must be True or False, got "
                             f"{self.int8_activations!r}")
        if self.int8_activations and self.gguf_blocks is False and self.quant is None:
            raise ValueError("NeuronConfig.int8_activations applies to GGUF weights kept in their blocks "
                             "(Q8_0, Q4_0, Q4_1, the K-quants) or to int8 weights (quant): it cannot go with "
                             "gguf_blocks=False unless quant is set")
        if self.kv_cache_quant == "s8":
            self.kv_cache_quant = True
        if self.kv_cache_quant not in (True, False):
            raise ValueError("NeuronConfig.kv_cache_quant must be False, True or 's8' (int8 caches with a "
                             f"scale per slot and head), got {self.kv_cache_quant!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            accepted = ", ".join(map(repr, KV_CACHE_DTYPES))
            raise ValueError(f"NeuronConfig.kv_cache_dtype must be one of {accepted}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_quant:
            raise ValueError("NeuronConfig.kv_cache_dtype and kv_cache_quant both set the caches' type; "
                             "drop one of them")
        precision = self.f32_matmul_precision
        if not isinstance(precision, str) or precision.lower() not in F32_MATMUL_PRECISIONS:
            raise ValueError("NeuronConfig.f32_matmul_precision must be one of "
                             f"{', '.join(map(repr, F32_MATMUL_PRECISIONS))}, got {precision!r}")
        self.f32_matmul_precision = precision.lower()
        if self.cpu_kernels not in (None, True, False):
            raise ValueError("NeuronConfig.cpu_kernels must be None, True or False, got "
                             f"{self.cpu_kernels!r}")
        if self.extra:
            raise _not_yet("extra", self.extra)

    @staticmethod
    def _check_generation(config: Any) -> None:
        """sample() takes max_length, do_sample, top_k, top_p, temperature (per line with
        per_batch_line), global_top_k and eos_token_id from it; the rest is not built yet."""
        if not isinstance(config, GenerationConfig):
            raise ValueError("NeuronConfig.on_device_generation must be a GenerationConfig or None")
        refused = (
            # The settings are always run-time inputs of the sampler; compile-time constants are not built.
            ("dynamic", True, "; settings are inputs of the compiled sampler (update_generation_config "
                              "changes them without compiling)"),
            ("deterministic", False, "; each draw uses the seeded random state"),
        )
        for name, built, hint in refused:
            if getattr(config, name) != built:
                raise NotSupportedYet(f"GenerationConfig.{name}={getattr(config, name)!r} is not supported "
                                      f"yet; use {built!r}{hint}")

    @property
    def f32_dot_precision(self) -> str:
        """f32_matmul_precision as XLA names it ("tf32" is XLA's "default")."""
        return "default" if self.f32_matmul_precision == "tf32" else self.f32_matmul_precision

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if self.group_query_attention is not None:
            data["group_query_attention"] = self.group_query_attention.value
        if self.quant is not None:
            data["quant"] = self.quant.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> NeuronConfig:
        data = dict(data)
        if data.get("on_device_generation"):
            data["on_device_generation"] = GenerationConfig(**data["on_device_generation"])
        return cls(**data)
