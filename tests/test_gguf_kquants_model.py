"""GGUF weights kept in Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 blocks (the forms of llama.cpp's
Q4_K_M, Q5_K_M and Q6_K files) compute the same function as the same file widened to f32
at load: a tiny Llama whose rows are whole 256-value super-blocks, every matrix in one form."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_families_mistral_qwen2_mixtral import write_gguf
from test_llama_golden import relative_error
from tiny_llama import as_reference
from transformers import LlamaConfig, LlamaForCausalLM

from decoders import LlamaForSampling, NeuronConfig
from decoders.weights.stored import BLOCK_FORMS

FORMS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    """A tiny GQA Llama (hidden 256, intermediate 512, tied head) as a GGUF file, its matrices
    in one form, or in the types a function of the tensor name gives."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    model = as_reference(LlamaForCausalLM(config))
    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    made = {}

    def get(name: str, types=None):
        if name not in made:
            path = tmp_path_factory.mktemp(name) / f"tiny.{name}.gguf"
            kind = types or gguf.GGMLQuantizationType[BLOCK_FORMS[name].ggml_type]
            made[name] = write_gguf(path, model, state, "llama", weights_type=kind)
        return made[name]

    return get


def build(path, gguf_blocks, kernels, batch_size=2, amp="f32"):
    return LlamaForSampling.from_pretrained(
        path, batch_size=batch_size, n_positions=128, amp=amp, context_length_estimate=[16, 64],
        neuron_config=NeuronConfig(gguf_blocks=gguf_blocks, cpu_kernels=kernels)).to_neuron()


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.cpu_only), False],
                         ids=["cpu_kernels", "xla_dot"])
@pytest.mark.parametrize("form", FORMS)
def test_kquant_blocks_compute_what_the_weights_widened_at_load_compute(kquant_file, form, kernels):
    path = kquant_file(form)
    kept, widened = build(path, True, kernels), build(path, False, False)
    forms = dict(kept.lowering.gguf_blocks)
    assert set(forms.values()) == {form} and "lm_head.weight" in forms and "mlp.down.weight" in forms
    # On the device the layers' weights are the file's bytes: block_bytes per block of values.
    layout = BLOCK_FORMS[form]
    kept_bytes, f32_bytes = (sum(v.nbytes for layer in m.session.layers for k, v in layer.items()
                                 if "norm" not in k)
                             for m in (kept, widened))
    assert kept_bytes * 4 * layout.block_values == f32_bytes * layout.block_bytes

    prompts = [np.arange(3, 40) % 300 + 3, np.arange(90, 101)]
    tokens, logits = kept.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = widened.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[],
                                               output_scores=True)
    for step in range(len(logits)):
        assert relative_error(logits[step], expected_logits[step]) < 1e-5, step
    np.testing.assert_array_equal(tokens, expected)
