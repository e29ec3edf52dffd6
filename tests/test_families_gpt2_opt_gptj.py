"""GPT-2, OPT (norms before and after the residual sums) and GPT-J against HF transformers'
own models on the same tiny random weights.

Logits within 1e-4 (relative to the largest logit) over prefill and 20 decode steps,
identical greedy tokens over 110 new tokens crossing the 128 -> 256 token bucket, at batch 1
and at batch 2 with different prompt lengths, with and without pyhlo's CPU kernels; a
left-padded batch marked by attention_mask as HF generate() runs it; GPT-2 with context
broadcasting; config switches the pieces do not build refused by name.
"""
from __future__ import annotations

import pytest
import torch
from test_llama_golden import hf_greedy
from test_ragged_batches import left_padded
from tiny_families import make_model

from decoders import (
    GPT2ForSampling,
    GPT2ForSamplingWithContextBroadcasting,
    GPTJForSampling,
    NeuronConfig,
    NotSupportedYet,
    OPTForSampling,
)
from decoders.description import ConfigReader
from decoders.families import gpt2, opt, sampling_class

CLASSES = {"gpt2": GPT2ForSampling, "opt": OPTForSampling, "opt_post_norm": OPTForSampling,
           "gptj": GPTJForSampling}
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "xla_dot"])
VARIANTS = pytest.mark.parametrize("variant", list(CLASSES))


@pytest.fixture(scope="module")
def built(family_checkpoint):
    """Compiled models, one per (variant, kernels, batch size), shared by the tests that only sample."""
    models = {}

    def get(variant, kernels, batch_size=1):
        key = (variant, kernels, batch_size)
        if key not in models:
            models[key] = build(CLASSES[variant], family_checkpoint(variant)[1], kernels, batch_size)
        return models[key]

    return get


def build(cls, path, kernels, batch_size=1, **kwargs):
    return cls.from_pretrained(path, batch_size=batch_size, n_positions=256, context_length_estimate=[16, 64],
                               neuron_config=NeuronConfig(cpu_kernels=kernels), **kwargs).to_neuron()


@VARIANTS
def test_left_padded_batch_through_attention_mask_gives_hf_generate_output(family_checkpoint, built, variant):
    # HF counts positions from the mask (its cumsum), as we count them from each line's first
    # real token: learned positions (GPT-2, OPT with its offset) and rotary ones (GPT-J) agree.
    hf, _ = family_checkpoint(variant)
    model = built(variant, None, batch_size=2)
    ids, mask = left_padded(lengths=(9, 30))
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                           pad_token_id=0)
    out = model.sample(ids, sequence_length=ids.shape[1] + 30, top_k=1, eos_token_id=[], attention_mask=mask)
    assert torch.equal(out, expected)


def test_context_broadcasting_continues_each_prompt_several_times(family_checkpoint):
    hf, path = family_checkpoint("gpt2")
    model = build(GPT2ForSamplingWithContextBroadcasting, path, None, batch_size=6, prompt_batch_size=2)
    prompts = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(5))
    length = 60
    greedy = model.sample(prompts, sequence_length=length, top_k=1, eos_token_id=[])
    assert greedy.shape == (6, length)
    for i in range(2):
        expected, _ = hf_greedy(hf, prompts[i:i + 1], length)
        for j in range(3):                         # lines 3i .. 3i + 2 continue prompt i
            assert torch.equal(greedy[3 * i + j], expected[0]), (i, j)
    sampled = model.sample(prompts, sequence_length=length, top_k=320, temperature=3.0, eos_token_id=[],
                           seed=7)
    assert torch.equal(sampled[:, :20], prompts.repeat_interleave(3, 0))
    for i in range(2):
        continuations = {tuple(sampled[3 * i + j, 20:].tolist()) for j in range(3)}
        assert len(continuations) == 3, i
    with pytest.raises(ValueError, match="prompt_batch_size=2"):
        model.sample(prompts[:1], sequence_length=length)


def test_context_broadcasting_needs_a_batch_that_is_a_multiple_of_the_prompts(family_checkpoint):
    _, path = family_checkpoint("gpt2")
    with pytest.raises(ValueError, match="batch_size 5 must be a multiple of prompt_batch_size 2"):
        GPT2ForSamplingWithContextBroadcasting.from_pretrained(path, batch_size=5, prompt_batch_size=2)
    with pytest.raises(ValueError, match="prompt_batch_size must be an int >= 1"):
        GPT2ForSamplingWithContextBroadcasting.from_pretrained(path, batch_size=2, prompt_batch_size=0)


def test_checkpoint_names_without_the_base_prefix(family_checkpoint, tmp_path):
    # GPT-2's own checkpoint names its tensors "h.0.attn.c_attn.weight", not "transformer.h.0...".
    from safetensors.torch import load_file, save_file

    hf, path = family_checkpoint("gpt2")
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = build(GPT2ForSampling, tmp_path, None)
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(6))
    expected, _ = hf_greedy(hf, prompt, 30)
    assert torch.equal(model.sample(prompt, sequence_length=30, top_k=1, eos_token_id=[]), expected)


def test_families_are_registered_by_model_type():
    assert sampling_class("gpt2") is GPT2ForSampling
    assert sampling_class("opt") is OPTForSampling
    assert sampling_class("gptj") is GPTJForSampling


CONFIGS = {
    "gpt2": (gpt2, dict(model_type="gpt2", vocab_size=320, n_embd=64, n_head=4, n_layer=2, n_positions=256)),
    "opt": (opt, dict(model_type="opt", vocab_size=320, hidden_size=64, num_attention_heads=4,
                      num_hidden_layers=2, ffn_dim=160, max_position_embeddings=256)),
}


@pytest.mark.parametrize("family, key, value", [
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),    # a scale per layer; one block program serves all
    ("gpt2", "scale_attn_weights", False),
    ("gpt2", "add_cross_attention", True),
    ("opt", "layer_norm_elementwise_affine", False),
], ids=lambda value: str(value))
def test_unsupported_config_switches_are_refused_by_name(family, key, value):
    module, config = CONFIGS[family]
    module.describe(ConfigReader(config, family))              # the defaults build
    with pytest.raises(NotSupportedYet, match=f"{key}={value!r} is not supported yet"):
        module.describe(ConfigReader({**config, key: value}, family))


@pytest.mark.parametrize("variant", ["gpt2", "opt"])
def test_n_positions_beyond_the_learned_position_table_is_refused(family_checkpoint, variant):
    _, path = family_checkpoint(variant)
    rows = make_model(variant).config.max_position_embeddings
    with pytest.raises(ValueError, match=f"n_positions {rows + 1} exceeds the {rows} positions"):
        CLASSES[variant].from_pretrained(path, n_positions=rows + 1, context_length_estimate=[16])
