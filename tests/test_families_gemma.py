"""Gemma 2 and Gemma 3: what the golden tests (tests/test_family_golden.py) rely on, the
layers of two kinds, configs as HF and older checkpoints write them, GGUF files written as
llama.cpp's converter writes them, and `pyhlo serve`."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from test_llama_golden import hf_greedy, relative_error
from tiny_families import WINDOW

from decoders import Gemma2ForSampling, Gemma3ForSampling, NeuronAutoModelForCausalLM, NeuronConfig
from decoders.checkpoints import open_checkpoint
from decoders.config import NotSupportedYet
from decoders.description import ConfigReader
from decoders.families import gemma2, gemma3
from decoders.programs.keys import Block

FULL = ["full_attention"] * 3


def hf_like(hf, **changes):
    """HF's model of the same class and weights, with config changes."""
    config = type(hf.config).from_dict({**hf.config.to_dict(), **changes})
    config._attn_implementation = "eager"
    model = type(hf)(config).eval()
    model.load_state_dict(hf.state_dict())
    return model


def logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits


# -- what the golden tests rely on ----------------------------------------------------------------

@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_reference_depends_on_the_window_of_its_sliding_layers(family_checkpoint, variant):
    """The golden test's 150 tokens cross the window: HF's logits past it change when the window
    is widened past them, and not before it."""
    hf, _ = family_checkpoint(variant)
    tokens = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    windowed, full = logits(hf, tokens), logits(hf_like(hf, sliding_window=1000), tokens)
    assert relative_error(windowed[0, :WINDOW], full[0, :WINDOW]) < 1e-5
    assert relative_error(windowed, full) > 1e-2


def test_gemma2_reference_soft_caps_scores_and_logits(family_checkpoint):
    hf, _ = family_checkpoint("gemma2")
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    capped = logits(hf, tokens)
    assert capped.abs().max() < 8.0
    assert relative_error(logits(hf_like(hf, final_logit_softcapping=None), tokens), capped) > 1e-2
    uncapped_scores = hf_like(hf, attn_logit_softcapping=None)
    assert relative_error(logits(uncapped_scores, tokens), capped) > 1e-2


def test_layers_of_two_kinds_each_with_its_block_program(family_checkpoint):
    _, path = family_checkpoint("gemma3")
    model = Gemma3ForSampling.from_pretrained(path, n_positions=128, context_length_estimate=[32],
                                              neuron_config=NeuronConfig(cpu_kernels=False))
    decoder = model.decoder
    assert [decoder.kind_of(i) for i in range(3)] == [0, 0, 1]       # sliding, sliding, global
    sliding, full = (kind.attention for kind in decoder.kinds)
    assert (sliding.window, full.window) == (WINDOW, None)
    assert sliding.positions.inv_freq[1] == pytest.approx(10_000 ** (-2 / 24))
    assert full.positions.inv_freq[1] == pytest.approx(1e6 ** (-2 / 24) / 4)      # linear factor 4
    assert sliding.scale == full.scale == pytest.approx(20 ** -0.5)                # query_pre_attn_scalar
    keys = model.session.eager_programs()
    assert Block(32, 32, kind=0) in keys and Block(32, 32, kind=1) in keys


def test_gemma2_layers_alternate_and_soft_cap(family_checkpoint):
    _, path = family_checkpoint("gemma2")
    decoder = Gemma2ForSampling.from_pretrained(path, n_positions=128).decoder
    assert [decoder.kind_of(i) for i in range(3)] == [0, 1, 0]
    assert [kind.attention.softcap for kind in decoder.kinds] == [3.0, 3.0]
    assert decoder.head.softcap == 8.0 and decoder.embedding.scale == 8.0         # sqrt(hidden 64)


# -- configs ------------------------------------------------------------------------------------

GEMMA3_CONFIG = dict(model_type="gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=16, vocab_size=320, intermediate_size=96, num_hidden_layers=12,
                     sliding_window=512)


def test_gemma3_config_before_transformers_5_reads_like_the_nested_one():
    older = gemma3.describe(ConfigReader({**GEMMA3_CONFIG, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                          "sliding_window_pattern": 6}, "gemma3"))
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    nested = gemma3.describe(ConfigReader({**GEMMA3_CONFIG, "layer_types": kinds, "rope_parameters": rope},
                                          "gemma3"))
    assert older == nested
    assert [older.kind_of(i) for i in range(12)] == ([0] * 5 + [1]) * 2
    assert older.head.softcap is None and older.layer.attention.softcap is None


def test_gemma2_explicit_nulls_turn_soft_capping_off_and_bidirectional_attention_is_refused():
    config = {**GEMMA3_CONFIG, "model_type": "gemma2", "attn_logit_softcapping": None,
              "final_logit_softcapping": None}
    decoder = gemma2.describe(ConfigReader(config, "gemma2"))
    assert decoder.head.softcap is None and decoder.layer.attention.softcap is None
    assert [decoder.kind_of(i) for i in range(4)] == [0, 1, 0, 1]
    with pytest.raises(NotSupportedYet, match="use_bidirectional_attention"):
        gemma2.describe(ConfigReader({**config, "use_bidirectional_attention": True}, "gemma2"))
    with pytest.raises(ValueError, match="layer_types must give 12 layers"):
        gemma2.describe(ConfigReader({**config, "layer_types": FULL}, "gemma2"))


# -- GGUF files as llama.cpp writes them --------------------------------------------------------

GGUF_BLOCKS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}


def write_gguf(path, hf, arch: str):
    """`hf` as llama.cpp's converter writes it: norms stored 1 + w, q and k rows as they are, no
    query_pre_attn_scalar (the reference has llama.cpp's, head_dim); Gemma 3's layer kinds as one
    flag per layer and its local rotary base."""
    config = hf.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    else:
        full, local = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_freq_base_swa(local["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue                                      # tied: llama.cpp's converter drops it
        array = tensor.numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        base, suffix = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, layer, inner = base.split(".", 3)
            gguf_name = f"blk.{layer}.{GGUF_BLOCKS[inner]}.{suffix}"
        else:
            gguf_name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}[base] + "." + suffix
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant, cls", [("gemma2", Gemma2ForSampling), ("gemma3", Gemma3ForSampling)])
def test_gguf_file_gives_hfs_tensors_and_tokens(family_checkpoint, tmp_path, variant, cls):
    hf, _ = family_checkpoint(variant)
    hf = hf_like(hf, query_pre_attn_scalar=hf.config.head_dim)
    path = write_gguf(tmp_path / f"{variant}.gguf", hf, variant)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with open_checkpoint(path) as ckpt:
        assert sorted(ckpt.names()) == sorted(state)
        for name, tensor in state.items():
            np.testing.assert_allclose(ckpt.get(name), tensor.numpy(), rtol=0, atol=1e-6, err_msg=name)
        assert ckpt.config["layer_types"] == hf.config.layer_types if variant == "gemma3" else True
    model = NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=128, context_length_estimate=[32])
    assert type(model) is cls
    model.to_neuron()
    prompt = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(4))
    expected, expected_logits = hf_greedy(hf, prompt, 100)            # past the window of 48
    tokens, scores = model.sample(prompt, sequence_length=100, top_k=1, eos_token_id=[], output_scores=True)
    assert torch.equal(tokens, expected)
    for step in (0, 40):
        assert relative_error(scores[step], expected_logits[step]) < 1e-4


def test_gguf_without_gemma3s_pattern_and_local_base_takes_llama_cpps(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "g3.gguf", "gemma3")
    for add, value in ((writer.add_block_count, 62), (writer.add_embedding_length, 5376),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 32),
                       (writer.add_head_count_kv, 16), (writer.add_key_length, 128),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, 1024),
                       (writer.add_vocab_size, 8)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open_checkpoint(tmp_path / "g3.gguf") as ckpt:
        config = ckpt.config
    assert (config["model_type"], config["sliding_window_pattern"], config["rope_local_base_freq"],
            config["rope_theta"], config["sliding_window"]) == ("gemma3_text", 6, 1e4, 1e6, 1024)
    assert config["query_pre_attn_scalar"] == 5376 // 32                # the 27B's scale, as llama.cpp's


# -- pyhlo serve -------------------------------------------------------------------------------

def test_serve_answers_what_hf_gives(family_checkpoint, tmp_path):
    """The OpenAI API's greedy completion of a prompt under continuous batching, decode crossing
    the window: HF's greedy tokens, up to the model's end-of-sequence token."""
    from fastapi.testclient import TestClient
    from tiny_tokenizer import make_tokenizer

    from decoders import ContinuousBatchingConfig
    from serving.engine import Engine
    from serving.openai_api import create_app

    hf, path = family_checkpoint("gemma3")
    directory = tmp_path / "gemma3"
    shutil.copytree(path, directory)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(directory)
    prompt = torch.randint(3, 320, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=2))
    model = NeuronAutoModelForCausalLM.from_pretrained(directory, batch_size=2, n_positions=128,
                                                       context_length_estimate=[32], neuron_config=config)
    engine = Engine(model.to_neuron(), "gemma3").start()
    try:
        with TestClient(create_app(engine)) as client:
            request = {"model": "gemma3", "prompt": prompt, "max_tokens": 40, "temperature": 0}
            reply = client.post("/v1/completions", json=request)
    finally:
        engine.stop()
    assert reply.status_code == 200, reply.text
    expected, _ = hf_greedy(hf, torch.tensor([prompt]), 30 + 40)
    new = expected[0, 30:].tolist()
    eos = set(model.eos_ids())
    new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
    assert len(new) > 20
    assert reply.json()["choices"][0]["text"].split() == tokenizer.decode(new).split()


def test_token_rows_scaled_by_sqrt_hidden_rounded_to_bf16_as_hf_rounds_it():
    """A bf16 Gemma's sqrt(48) is 6.9375, not 6.928: HF multiplies by the scale in the table's type."""
    from test_blocks import _run

    from decoders.blocks import Embedding
    from decoders.blocks.values import PieceValues
    from decoders.lowering import XlaLowering

    table = np.random.default_rng(0).standard_normal((11, 48)).astype(np.float32)
    ids = np.array([[3, 7, 0]], np.int32)
    emb = Embedding("tok", 11, 48, scale=48 ** 0.5)
    lowering = XlaLowering("bf16")

    def body(v):
        rows = emb(PieceValues(v, lowering, "embed", []), v["table"], v["ids"], None, "bf16")
        return [rows.scribe.f32[rows.dims].Convert(rows)]

    (ours,) = _run({"table": table, "ids": ids}, body)
    rows = torch.nn.functional.embedding(torch.from_numpy(ids).long(), torch.from_numpy(table).bfloat16())
    hf = (rows * torch.tensor(48 ** 0.5).to(torch.bfloat16)).float().numpy()
    np.testing.assert_allclose(ours, hf, rtol=2 ** -8)         # XLA may keep the product in f32
    # The factor itself: 6.9375, where sqrt(48) = 6.928 would be 0.14 % lower.
    assert np.median(ours / rows.float().numpy()) == pytest.approx(6.9375, rel=2e-4)
