"""Qwen3, Qwen3-MoE and Phi-3 / Phi-4 beyond the golden tables (tests/test_family_golden.py,
tests/test_tensor_parallel.py): LongRoPE's long factors, configs refused with their reason,
GGUF files named and described as llama.cpp's converter writes them ("qwen3", "qwen3moe",
"phi3"), and `pyhlo serve`'s engine, each against HF transformers' own model on the same
weights."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_llama_golden import hf_greedy, relative_error
from tiny_families import LLAMA_SHAPE, longrope_scaling, make_model, save
from tiny_llama import as_reference
from transformers import Phi3Config, Phi3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from decoders import (
    NeuronAutoModelForCausalLM,
    NeuronConfig,
    NotSupportedYet,
    Phi3ForSampling,
    Qwen3ForSampling,
    Qwen3MoeForSampling,
)
from decoders.checkpoints import open_checkpoint
from decoders.checkpoints.base import CheckpointError


def greedy_matches_hf(hf, path, prompt_length: int = 40, length: int = 100, **kwargs) -> None:
    """Greedy tokens over `length` and logits over prefill and 20 steps, as HF's."""
    model = NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=256, context_length_estimate=[64],
                                                       **kwargs).to_neuron()
    prompt = torch.randint(0, 320, (1, prompt_length), generator=torch.Generator().manual_seed(4))
    expected, expected_logits = hf_greedy(hf, prompt, length)
    tokens, logits = model.sample(prompt, sequence_length=length, top_k=1, eos_token_id=[],
                                  output_scores=True)
    assert torch.equal(tokens, expected)
    for step in range(21):
        assert relative_error(logits[step], expected_logits[step]) < 1e-4, step


# -- LongRoPE ------------------------------------------------------------------------------------

def test_longrope_past_the_original_context_runs_hfs_long_factors(tmp_path):
    """A model of more positions than the original context (32) runs the long factors: HF's
    too, for a prompt (40 tokens) already past it. (The golden table's phi3_longrope runs the
    short ones: a model of 256 positions, an original context of 512.)"""
    torch.manual_seed(0)
    hf = as_reference(Phi3ForCausalLM(Phi3Config(
        **{**LLAMA_SHAPE, "max_position_embeddings": 4096}, original_max_position_embeddings=32,
        rope_parameters=longrope_scaling(32), pad_token_id=0, bos_token_id=1, eos_token_id=2)))
    greedy_matches_hf(hf, save(hf, tmp_path))
    model = Phi3ForSampling.from_pretrained(tmp_path, n_positions=256)
    rotary = model.decoder.layer.attention.positions
    assert rotary.rotary_dim == 12 and rotary.scale == pytest.approx(np.sqrt(1 + np.log(128) / np.log(32)))
    np.testing.assert_allclose(rotary.inv_freq, hf.model.rotary_emb.long_inv_freq, rtol=1e-6)


def test_longrope_factors_of_the_wrong_length_are_refused(tmp_path):
    save(make_model("phi3_longrope"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["long_factor"].pop()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="long_factor has 5 values; LongRoPE over 12 rotary features "
                                         "needs 6"):
        Phi3ForSampling.from_pretrained(tmp_path)


# -- configs refused -----------------------------------------------------------------------------

def qwen3_moe(**settings) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return as_reference(Qwen3MoeForCausalLM(Qwen3MoeConfig(**LLAMA_SHAPE, head_dim=16, num_experts=4,
                                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                                           **settings)))


@pytest.mark.parametrize("settings, refused", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\] is not supported yet"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported yet"),
])
def test_qwen3_moe_with_dense_layers_among_the_experts_is_refused(tmp_path, settings, refused):
    save(qwen3_moe(**settings), tmp_path)
    with pytest.raises(NotSupportedYet, match=refused):
        Qwen3MoeForSampling.from_pretrained(tmp_path)


# -- GGUF files as llama.cpp writes them ---------------------------------------------------------

def write_gguf(path, hf, arch: str, weights_type=None, rope_tensors=("long", "short")):
    """The model's safetensors as llama.cpp's converter writes them for `arch`: its tensor names
    (gguf's own name map), experts stacked [n_expert, ...], q and k rows as HF has them, the
    metadata its converter writes (Phi-3: the rotary part of a head, the original context,
    the sliding window, LongRoPE's attention factor and factors as tensors). `weights_type`: a
    GGMLQuantizationType every matrix is quantized to."""
    config = hf.config
    state = load_file(str(save(hf, path.parent / f"{path.stem}_hf") / "model.safetensors"))
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        partial = rope.get("partial_rotary_factor", 1.0)
        rotary = int(partial * config.hidden_size) // config.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = config.max_position_embeddings / config.original_max_position_embeddings
            original = config.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
            for which in rope_tensors:
                writer.add_tensor(f"rope_factors_{which}.weight",
                                  np.asarray(rope[f"{which}_factor"], np.float32))
        assert rotary <= head_dim
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in state.items():
        if ".experts." in name:                     # model.layers.L.mlp.experts.E.gate_proj.weight
            before, _, after = name.partition(".experts.")
            expert, which = after.split(".", 1)
            experts.setdefault(f"{before}.experts.{which}", {})[int(expert)] = array
            continue
        add(writer, names.get_name(name, try_suffixes=(".weight", ".bias")), array, weights_type)
    for name, by_expert in experts.items():
        add(writer, names.get_name(name, try_suffixes=(".weight",)),
            np.stack([by_expert[e] for e in sorted(by_expert)]), weights_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, state


def add(writer, name: str, array: np.ndarray, weights_type) -> None:
    if weights_type is None or array.ndim < 2:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), weights_type),
                          raw_dtype=weights_type)


GGUF_CASES = {
    # case: (the HF model, GGUF architecture, the class NeuronAutoModelForCausalLM picks)
    "qwen3": (lambda: make_model("qwen3"), "qwen3", Qwen3ForSampling),
    # llama.cpp renormalises Qwen3-MoE's chosen experts' weights, as norm_topk_prob=True
    "qwen3_moe": (lambda: qwen3_moe(norm_topk_prob=True), "qwen3moe", Qwen3MoeForSampling),
    "phi3": (lambda: make_model("phi3"), "phi3", Phi3ForSampling),              # a sliding window
    "phi3_longrope": (lambda: make_model("phi3_longrope"), "phi3", Phi3ForSampling),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_file_gives_hfs_tensors_config_and_tokens(tmp_path, case):
    maker, arch, cls = GGUF_CASES[case]
    hf = maker()
    path, state = write_gguf(tmp_path / f"{case}.gguf", hf, arch)
    with open_checkpoint(path) as ckpt:
        assert sorted(ckpt.names()) == sorted(state)
        for name, array in state.items():
            np.testing.assert_array_equal(ckpt.get(name), array, err_msg=name)
        config = ckpt.config
    assert config["model_type"] == hf.config.model_type
    assert config["tie_word_embeddings"] is hf.config.tie_word_embeddings
    if arch == "phi3":
        assert config.get("sliding_window") == hf.config.sliding_window
        rope = config["rope_parameters"]
        assert rope.get("partial_rotary_factor", 1.0) == hf.config.rope_parameters["partial_rotary_factor"]
        if case == "phi3_longrope":
            assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 512
            for key in ("long_factor", "short_factor"):
                np.testing.assert_allclose(rope[key], hf.config.rope_parameters[key], rtol=1e-7)
    assert type(NeuronAutoModelForCausalLM.from_pretrained(path)) is cls
    greedy_matches_hf(hf, path, prompt_length=20)


def test_phi3_q8_0_file_runs_its_fused_qkv_and_gate_up_as_stored(tmp_path):
    """Q8_0 blocks of the fused qkv and gate|up projections run as stored: the tokens and
    logits of the same file widened at load."""
    path, _ = write_gguf(tmp_path / "phi3_q8.gguf", make_model("phi3_longrope"), "phi3",
                         weights_type=gguf.GGMLQuantizationType.Q8_0)
    prompt = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(4))
    runs = []
    for blocks in (True, False):
        model = Phi3ForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[32],
                                                neuron_config=NeuronConfig(gguf_blocks=blocks))
        forms = {p.name: p.quant for p in model.session.builder.layer_params()}
        fused = (forms["attn.qkv.weight"], forms["mlp.gate_up.weight"])
        assert fused == (("q8_0", "q8_0") if blocks else (None, None))
        runs.append(model.to_neuron().sample(prompt, sequence_length=80, top_k=1, eos_token_id=[],
                                             output_scores=True))
    (kept, kept_logits), (widened, widened_logits) = runs
    assert torch.equal(kept, widened)
    for step in range(21):
        assert relative_error(kept_logits[step], widened_logits[step]) < 1e-4, step


def test_a_phi3_file_with_one_longrope_factor_tensor_is_refused(tmp_path):
    path, _ = write_gguf(tmp_path / "phi3.gguf", make_model("phi3_longrope"), "phi3",
                         rope_tensors=("long",))
    with pytest.raises(CheckpointError, match="LongRoPE needs both tensors rope_factors_long and "
                                              "rope_factors_short; the file has one"):
        open_checkpoint(path)


# -- pyhlo serve ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["qwen3", "phi3_longrope"])
def test_serve_engine_gives_each_request_hfs_greedy_tokens(tmp_path, variant):
    """`pyhlo serve`'s engine over the family's checkpoint: five requests through two lines of
    continuous batching, each getting the tokens HF's greedy search gives its prompt alone."""
    from test_continuous_batching import hf_greedy as hf_greedy_alone
    from test_server import serve_args
    from tiny_tokenizer import make_tokenizer

    from tools.serve import build_engine

    hf = make_model(variant)
    make_tokenizer().save_pretrained(save(hf, tmp_path))
    engine = build_engine(serve_args("-m", str(tmp_path), "--max-num-seqs", "2", "--max-model-len", "64",
                                     "--context-length-estimate", "8,16"))
    assert engine.model.family.name == variant.split("_")[0]
    rng = np.random.default_rng(0)
    requests = [engine.batcher.submit(rng.integers(3, 320, length).tolist(), max_new_tokens=budget)
                for length, budget in ((5, 12), (19, 6), (1, 9), (9, 15), (30, 4))]
    while engine.batcher.busy:
        engine.batcher.step()
    for request in requests:
        assert request.tokens == hf_greedy_alone(hf, request.prompt, request.max_new_tokens), request.id
