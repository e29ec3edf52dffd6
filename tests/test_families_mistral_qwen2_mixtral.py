"""Mistral, Qwen2 and Mixtral against HF transformers' own models on the same tiny random weights,
from HF checkpoints and from GGUF files written as llama.cpp's converter writes them.

Logits within 1e-4 (relative to the largest logit) over prefill and 20 decode steps,
identical greedy tokens over 110 new tokens crossing the 128 -> 256 token bucket (and
Mistral's 48-token sliding window), at batch 1 and at batch 2 with different prompt lengths,
with and without pyhlo's CPU kernels.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_gguf_checkpoint import GGUF_NAMES, llama_cpp_permute
from test_llama_golden import hf_greedy, relative_error
from tiny_families import WINDOW
from transformers import MistralConfig, Qwen2Config
from transformers.masking_utils import sliding_window_causal_mask_function

from decoders import (
    LlamaForSampling,
    MistralForSampling,
    MixtralForSampling,
    NeuronAutoModelForCausalLM,
    NeuronConfig,
    Qwen2ForSampling,
)
from decoders.blocks import MoE
from decoders.checkpoints import CheckpointError, open_checkpoint
from decoders.config import NotSupportedYet
from decoders.description import ConfigReader
from decoders.families import mistral, qwen2
from decoders.programs.keys import ModelStep
from pyhlo.ops import nn

CLASSES = {"mistral": MistralForSampling, "qwen2": Qwen2ForSampling, "qwen2_window": Qwen2ForSampling,
           "mixtral": MixtralForSampling}
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "xla_dot"])


def build(cls, path, kernels=None, batch_size=1, n_positions=256, context=(16, 64)):
    return cls.from_pretrained(path, batch_size=batch_size, n_positions=n_positions,
                               context_length_estimate=list(context),
                               neuron_config=NeuronConfig(cpu_kernels=kernels)).to_neuron()


def expert_pairs(hf, tokens: torch.Tensor) -> list[set[tuple[int, ...]]]:
    """Per layer, the sets of experts HF's router picks for the tokens of `tokens`."""
    with torch.no_grad():
        router_logits = hf(tokens, output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    return [{tuple(sorted(row)) for row in torch.topk(logits, k, dim=-1).indices.tolist()}
            for logits in router_logits]


def window_matters(hf, tokens: torch.Tensor) -> bool:
    """Whether HF's logits past the window change when the window is taken away."""
    with torch.no_grad():
        windowed = hf(tokens).logits
        hf.config.sliding_window = None
        try:
            full = hf(tokens).logits
        finally:
            hf.config.sliding_window = WINDOW
    return (relative_error(windowed[0, :WINDOW], full[0, :WINDOW]) < 1e-5
            and relative_error(windowed, full) > 1e-2)


# -- what the golden tests (tests/test_family_golden.py) rely on -------------------------------

def test_mistral_reference_depends_on_its_window(family_checkpoint):
    """The golden test's 150 tokens cross the window, and HF's logits past it depend on it."""
    hf, path = family_checkpoint("mistral")
    tokens = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    assert window_matters(hf, tokens)
    assert build(MistralForSampling, path).decoder.layer.attention.window == WINDOW


def test_mixtral_reference_routes_tokens_to_several_expert_pairs(family_checkpoint):
    hf, _ = family_checkpoint("mixtral")
    tokens = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    assert all(len(pairs) > 1 for pairs in expert_pairs(hf, tokens))


# -- sliding windows and the descriptions ---------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 48])
def test_causal_mask_window_is_hfs(window):
    """A query at position p sees keys p - window < k <= p, as HF's sliding-window mask."""
    from hlo_run import run_fn

    n = 64
    positions = np.arange(n, dtype=np.int32)[None]
    (ours,) = run_fn(lambda scribe: nn.causal_mask(scribe.s32[1, n].Parameter(parameter_number=0), n, window),
                     positions)
    visible = sliding_window_causal_mask_function(window)
    hfs = np.array([[visible(0, 0, torch.tensor(q), torch.tensor(k)).item() for k in range(n)]
                    for q in range(n)])
    np.testing.assert_array_equal(ours[0], hfs)


def _window(family, config) -> int | None:
    return family.describe(ConfigReader(config.to_dict(), "test")).layer.attention.window


SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=160,
             vocab_size=320, num_hidden_layers=2)


def test_mistral_window_follows_the_config():
    assert _window(mistral, MistralConfig(**SHAPE, sliding_window=48)) == 48
    assert _window(mistral, MistralConfig(**SHAPE, sliding_window=None)) is None


@pytest.mark.parametrize("saved_layer_types", [True, False], ids=["layer_types", "older_config"])
def test_qwen2_window_on_every_layer_or_none(saved_layer_types):
    def window(**kwargs):
        config = Qwen2Config(**SHAPE, sliding_window=48, **kwargs).to_dict()
        if not saved_layer_types:
            config.pop("layer_types")
        config["sliding_window"] = 48          # as older Qwen2 configs keep it when the window is off
        return qwen2.describe(ConfigReader(config, "qwen2")).layer.attention.window

    assert window(use_sliding_window=False) is None
    assert window(use_sliding_window=True, max_window_layers=0) == 48
    assert window(use_sliding_window=True, max_window_layers=2) is None     # no layer from 2 on
    with pytest.raises(NotSupportedYet, match="sliding window on only some layers .1 of 2."):
        window(use_sliding_window=True, max_window_layers=1)


def test_qwen2_biases_on_q_k_v_only(family_checkpoint):
    _, path = family_checkpoint("qwen2")
    model = Qwen2ForSampling.from_pretrained(path, n_positions=128)
    names = {p.name for p in model.session.builder.layer_params()}
    assert "attn.qkv.bias" in names and "attn.out.bias" not in names
    assert model.decoder.tied


def test_mixtral_layer_declares_each_expert(family_checkpoint):
    _, path = family_checkpoint("mixtral")
    model = MixtralForSampling.from_pretrained(path, n_positions=128)
    moe = model.decoder.layer.mlp
    assert isinstance(moe, MoE) and (len(moe.experts), moe.top_k) == (4, 2)
    names = {p.name for p in model.session.builder.layer_params()}
    assert {"mlp.router.weight", "mlp.experts.3.gate_up.weight", "mlp.experts.3.down.weight"} <= names


# -- GGUF files as llama.cpp writes them ----------------------------------------------------

BLOCK_NAMES = {**GGUF_NAMES, "block_sparse_moe.gate": "ffn_gate_inp"}
STACKED = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_gguf(path, hf, state: dict[str, np.ndarray], arch: str, expert_metadata: bool = True,
               vocabulary: bool = False, weights_type=None):
    """`state` (HF names) as llama.cpp's converter writes it: "llama" files with q and k rows
    permuted for its rotary kernel, experts stacked [n_expert, ...]; "qwen2" files as they are.
    `vocabulary`: with a toy SentencePiece vocabulary (<unk>, <s>, </s>, then t3, t4, ...),
    so that llama.cpp itself can load the file. `weights_type`: a GGMLQuantizationType every
    matrix (not the norms and biases) is quantized to, or a function of the GGUF tensor name
    giving one (None: as it is)."""
    from gguf_kquants import quantize

    def add(name: str, array: np.ndarray) -> None:
        kind = weights_type(name) if callable(weights_type) and array.ndim > 1 else weights_type
        if kind is None or array.ndim < 2:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array.astype(np.float32), kind), raw_dtype=kind)

    config = hf.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if vocabulary:
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, config.vocab_size)])
        writer.add_token_scores([0.0] * config.vocab_size)
        writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                               + [gguf.TokenType.NORMAL] * (config.vocab_size - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    if getattr(config, "num_local_experts", None) and expert_metadata:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, array in state.items():
        base, suffix = name.rsplit(".", 1)
        if ".experts." in base:                    # model.layers.L.block_sparse_moe.experts.E.wN
            _, _, layer, _, _, expert, which = base.split(".")
            experts.setdefault((layer, which), {})[int(expert)] = array
            continue
        if base.startswith("model.layers."):
            _, _, layer, inner = base.split(".", 3)
            gguf_name = f"blk.{layer}.{BLOCK_NAMES[inner]}.{suffix}"
        else:
            gguf_name = f"{GGUF_NAMES[base]}.{suffix}"
        if arch == "llama" and ".attn_q." in gguf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        add(gguf_name, array)
    for (layer, which), by_expert in experts.items():
        add(f"blk.{layer}.{STACKED[which]}.weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_CASES = {
    # variant: (GGUF architecture, the class NeuronAutoModelForCausalLM picks, config model_type)
    "qwen2": ("qwen2", Qwen2ForSampling, "qwen2"),
    "mistral_full": ("llama", LlamaForSampling, "llama"),   # llama.cpp writes Mistral as Llama
    "mixtral": ("llama", MixtralForSampling, "mixtral"),
}


@pytest.mark.parametrize("variant", list(GGUF_CASES))
def test_gguf_file_gives_hfs_tensors_and_tokens(family_checkpoint, tmp_path, variant):
    arch, cls, model_type = GGUF_CASES[variant]
    hf, directory = family_checkpoint(variant)
    state = load_file(str(directory / "model.safetensors"))
    path = write_gguf(tmp_path / f"{variant}.gguf", hf, state, arch)
    with open_checkpoint(path) as ckpt:
        assert sorted(ckpt.names()) == sorted(state)
        for name, array in state.items():
            np.testing.assert_array_equal(ckpt.get(name), array, err_msg=name)
        config = ckpt.config
    assert config["model_type"] == model_type
    assert config["tie_word_embeddings"] is hf.config.tie_word_embeddings
    if variant == "mixtral":
        assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    model = NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=128, context_length_estimate=[32])
    assert type(model) is cls
    model.to_neuron()
    prompt = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(4))
    expected, expected_logits = hf_greedy(hf, prompt, 100)
    tokens, logits = model.sample(prompt, sequence_length=100, top_k=1, eos_token_id=[], output_scores=True)
    assert torch.equal(tokens, expected)
    assert relative_error(logits[0], expected_logits[0]) < 1e-4


def test_gguf_experts_without_their_counts_are_refused(family_checkpoint, tmp_path):
    hf, directory = family_checkpoint("mixtral")
    path = write_gguf(tmp_path / "mixtral.gguf", hf, load_file(str(directory / "model.safetensors")), "llama",
                      expert_metadata=False)
    with pytest.raises(CheckpointError, match="llama.expert_count is missing"):
        open_checkpoint(path)


def test_gguf_quantized_stacked_experts_read_one_expert_each(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "experts.gguf", "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 64),
                       (writer.add_head_count, 4), (writer.add_feed_forward_length, 96),
                       (writer.add_expert_count, 3), (writer.add_expert_used_count, 2),
                       (writer.add_vocab_size, 8)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    stacked = np.random.default_rng(0).standard_normal((3, 96, 64)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("blk.0.ffn_up_exps.weight", gguf.quants.quantize(stacked, q8), raw_dtype=q8)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = gguf.quants.dequantize(gguf.quants.quantize(stacked, q8), q8)
    with open_checkpoint(tmp_path / "experts.gguf") as ckpt:
        assert ckpt.config["model_type"] == "mixtral"
        for e in range(3):
            name = f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"
            assert ckpt.shape(name) == (96, 64) and ckpt.quant_type(name) == "Q8_0"
            np.testing.assert_array_equal(ckpt.get(name), whole[e])


@pytest.mark.cpu_only
def test_the_decode_attention_kernel_takes_a_window_narrower_than_the_cache(family_checkpoint):
    from decoders.lowering import CpuKernelLowering

    hf, path = family_checkpoint("mistral")                  # window 48
    model = build(MistralForSampling, path, kernels=True, n_positions=128, context=(16,))
    # The kernel reads each line's slots within the window: one decode program for every length.
    assert isinstance(model.lowering, CpuKernelLowering) and model.decode_buckets() == [128]
    module = model.session.programs.build(ModelStep(1, 128)).module
    targets = {i.custom_call_target for c in module.computations for i in c.instructions}
    assert "pyhlo_decode_attention" in targets
    prompt = torch.randint(0, 320, (1, 10), generator=torch.Generator().manual_seed(5))
    expected, _ = hf_greedy(hf, prompt, 100)                 # decode runs 50 tokens past the window
    assert torch.equal(model.sample(prompt, sequence_length=100, top_k=1, eos_token_id=[]), expected)
