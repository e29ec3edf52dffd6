"""GGUF weights kept in their Q8_0, Q4_0 and Q4_1 blocks compute the same function as the
same file widened to f32 at load: a tiny Llama (every matrix quantized, the LM head too),
with pyhlo's CPU kernels and with XLA's own dot; and SmolLM2's own Q4_1 file."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from test_families_mistral_qwen2_mixtral import write_gguf
from test_llama_golden import relative_error

from decoders import LlamaForSampling, NeuronConfig, QuantizationConfig

FORMS = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module")
def block_file(tiny_llama, tmp_path_factory):
    """A tiny GQA Llama written as a GGUF file with every matrix in one block form."""
    model, _ = tiny_llama("gqa_tied_llama3", "safetensors")
    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    made = {}

    def get(form: str):
        if form not in made:
            path = tmp_path_factory.mktemp(form) / f"tiny.{form}.gguf"
            made[form] = write_gguf(path, model, state, "llama", weights_type=FORMS[form])
        return made[form]

    return get


def build(path, gguf_blocks, kernels, batch_size=2, amp="f32"):
    return LlamaForSampling.from_pretrained(
        path, batch_size=batch_size, n_positions=128, amp=amp, context_length_estimate=[16, 64],
        neuron_config=NeuronConfig(gguf_blocks=gguf_blocks, cpu_kernels=kernels)).to_neuron()


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.cpu_only), False],
                         ids=["cpu_kernels", "xla_dot"])
@pytest.mark.parametrize("form", list(FORMS))
def test_blocks_compute_what_the_weights_widened_at_load_compute(block_file, form, kernels):
    path = block_file(form)
    kept, widened = build(path, True, kernels), build(path, False, False)
    forms = dict(kept.lowering.gguf_blocks)
    assert set(forms.values()) == {form} and "lm_head.weight" in forms and "mlp.down.weight" in forms
    assert widened.lowering.gguf_blocks == ()
    # The layers' weights on the device are the file's blocks, byte for byte: 34 (Q8_0), 18
    # (Q4_0) or 20 (Q4_1) bytes per 32 values where f32 takes 128.
    block_bytes = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[form]
    kept_bytes, f32_bytes = (sum(v.nbytes for layer in m.session.layers for k, v in layer.items()
                                 if "norm" not in k)
                             for m in (kept, widened))
    assert kept_bytes * 128 == f32_bytes * block_bytes

    prompts = [np.arange(3, 40) % 300 + 3, np.arange(90, 101)]
    tokens, logits = kept.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = widened.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[],
                                               output_scores=True)
    for step in range(len(logits)):
        assert relative_error(logits[step], expected_logits[step]) < 1e-5, step
    np.testing.assert_array_equal(tokens, expected)


def test_bf16_products_over_blocks_follow_the_widened_weights(block_file):
    path = block_file("q4_1")
    kept, widened = (build(path, blocks, None, batch_size=1, amp="bf16") for blocks in (True, False))
    prompt = np.arange(5, 30)[None]
    _, logits = kept.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    _, expected = widened.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    assert relative_error(logits[0], expected[0]) < 2e-2


def test_presharded_save_and_load_keep_the_blocks(block_file, tmp_path):
    path = block_file("q8_0")
    model = build(path, None, None, batch_size=1)
    prompt = np.arange(3, 20)[None]
    tokens = model.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[])
    model.save(tmp_path / "saved", sharded_weights=True)
    again = LlamaForSampling.from_pretrained(path, batch_size=1, n_positions=128,
                                             context_length_estimate=[16, 64])
    again.load(tmp_path / "saved").to_neuron()
    assert again.lowering.gguf_blocks == model.lowering.gguf_blocks
    np.testing.assert_array_equal(again.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[]), tokens)


def test_blocks_that_cannot_be_kept_are_clear_errors(block_file, tiny_llama):
    path = block_file("q4_0")
    with pytest.raises(ValueError, match="tp_degree 1 only"):
        LlamaForSampling.from_pretrained(path, tp_degree=2, n_positions=128,
                                         neuron_config=NeuronConfig(gguf_blocks=True))
    with pytest.raises(ValueError, match="cannot be combined with quant"):
        NeuronConfig(gguf_blocks=True, quant=QuantizationConfig())
    _, hf_directory = tiny_llama("gqa_tied_llama3", "safetensors")
    with pytest.raises(ValueError, match="stores no linear weight in a GGUF block form pyhlo runs as stored"):
        LlamaForSampling.from_pretrained(hf_directory, n_positions=128,
                                         neuron_config=NeuronConfig(gguf_blocks=True))
    # The automatic choice widens them where blocks cannot run: under tensor parallelism, or with int8.
    assert LlamaForSampling.from_pretrained(path, n_positions=128,
                                            neuron_config=NeuronConfig(quant=QuantizationConfig())
                                            ).lowering.gguf_blocks == ()


@pytest.mark.cpu_only
@pytest.mark.parametrize("form", list(FORMS))
def test_int8_activations_round_the_block_products(block_file, form):
    """NeuronConfig(int8_activations=True): products of block weights on the kernels (decode
    steps, the LM head) run the _x8 kernels (activations rounded to int8 per 32 values), a
    prompt's products the int8 GEMM (where it has its fast form) instead of weights widened in
    the program, and the logits stay within the rounding's reach of the exact ones."""
    from decoders.programs.keys import Block
    from runtime import cpu_kernels

    path = block_file(form)
    exact = build(path, True, True, batch_size=1)
    rounded = LlamaForSampling.from_pretrained(
        path, batch_size=1, n_positions=128, context_length_estimate=[16, 64],
        neuron_config=NeuronConfig(gguf_blocks=True, cpu_kernels=True, int8_activations=True)).to_neuron()
    module = rounded.programs.build(Block(1, 128)).module
    targets = {i.custom_call_target for c in module.computations for i in c.instructions} - {""}
    assert f"pyhlo_matvec_{form}_x8" in targets and f"pyhlo_matvec_{form}" not in targets
    prefill = rounded.programs.build(Block(16, 128)).module
    targets = {i.custom_call_target for c in prefill.computations for i in c.instructions} - {""}
    assert (f"pyhlo_gemm_{form}_x8" in targets) == cpu_kernels.int8_gemm_is_fast()
    exact_prefill = exact.programs.build(Block(16, 128)).module
    targets = {i.custom_call_target for c in exact_prefill.computations for i in c.instructions} - {""}
    assert not any(target.endswith("_x8") for target in targets)
    assert (f"pyhlo_gemm_{form}" in targets) == cpu_kernels.exact_gemm_is_fast()
    prompt = np.arange(5, 30)[None]
    _, logits = rounded.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    _, expected = exact.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    for step in (0, 1):                                            # the prompt's token, a decode step
        assert 1e-7 < relative_error(logits[step], expected[step]) < 3e-2, step


def test_int8_activations_need_block_weights_and_the_kernels(block_file, tiny_llama):
    with pytest.raises(ValueError, match="cannot go with gguf_blocks=False unless quant is set"):
        NeuronConfig(gguf_blocks=False, int8_activations=True)
    with pytest.raises(ValueError, match="must be True or False"):
        NeuronConfig(int8_activations="yes")
    _, hf_directory = tiny_llama("gqa_tied_llama3", "safetensors")
    with pytest.raises(ValueError, match="this model has neither"):
        LlamaForSampling.from_pretrained(hf_directory, n_positions=128,
                                         neuron_config=NeuronConfig(int8_activations=True))
    with pytest.raises(ValueError, match="does not use"):
        LlamaForSampling.from_pretrained(block_file("q8_0"), n_positions=128,
                                         neuron_config=NeuronConfig(int8_activations=True, cpu_kernels=False))


@pytest.mark.cpu_only
def test_exact_block_weights_tell_once_of_int8_activations(block_file, monkeypatch, caplog):
    """Exact arithmetic stays the default for block weights; the first model that could round
    its activations says how (once a process), and a model that rounds them says nothing."""
    from decoders import platform_choice

    monkeypatch.setattr(platform_choice, "_hinted", False)
    caplog.set_level("INFO", logger="pyhlo.progress")

    def load(**config):
        caplog.clear()
        model = LlamaForSampling.from_pretrained(block_file("q4_0"), n_positions=128,
                                                 neuron_config=NeuronConfig(cpu_kernels=True, **config))
        return model, [r.getMessage() for r in caplog.records if r.name == "pyhlo.progress"]

    rounded, said = load(int8_activations=True)
    assert rounded.lowering.int8_activations and platform_choice.EXACT_BLOCKS_HINT not in said
    exact, said = load()
    assert not exact.lowering.int8_activations and exact.lowering.gguf_blocks
    assert said.count(platform_choice.EXACT_BLOCKS_HINT) == 1
    assert "int8_activations=True" in platform_choice.EXACT_BLOCKS_HINT
    assert platform_choice.EXACT_BLOCKS_HINT not in load()[1]


def first_divergence(tokens: np.ndarray, expected: np.ndarray) -> int | None:
    differ = np.nonzero(tokens != expected)[0]
    return int(differ[0]) if len(differ) else None


def test_smollm2_q4_1_as_stored_gives_the_tokens_of_the_file_widened_at_load(smollm2_gguf):
    """SmolLM2's own Q4_1 file (its LM head Q8_0): 3 prompts of 64 tokens, 64 new tokens each.
    Where a line's tokens differ, the first difference must be a near-tie of the widened
    model's logits (the two sums differ only in f32 rounding order)."""
    models = [LlamaForSampling.from_pretrained(smollm2_gguf, batch_size=3, n_positions=256,
                                               context_length_estimate=[64],
                                               neuron_config=NeuronConfig(gguf_blocks=kept))
              for kept in (True, False)]
    kept, widened = (m.to_neuron() for m in models)
    assert dict(kept.lowering.gguf_blocks)["lm_head.weight"] == "q8_0"
    assert dict(kept.lowering.gguf_blocks)["mlp.down.weight"] == "q4_1"
    texts = ["The history of the printing press begins", "def merge_sort(items):\n    \"\"\"Sort a list",
             "Photosynthesis is the process by which plants"]
    prompts = []
    for text in texts:
        ids = kept.tokenizer(text)["input_ids"]
        filler = kept.tokenizer(" and so on, as the story goes,")["input_ids"]
        while len(ids) < 64:
            ids = ids + filler
        prompts.append(ids[:64])
    prompt = np.array(prompts)
    tokens, _ = kept.sample(prompt, sequence_length=128, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_scores = widened.sample(prompt, sequence_length=128, top_k=1, eos_token_id=[],
                                               output_scores=True)
    for line in range(3):
        step = first_divergence(np.asarray(tokens[line]), np.asarray(expected[line]))
        if step is None:
            continue
        scores = np.asarray(expected_scores[step - 64][line])
        gap = scores[expected[line][step]] - scores[tokens[line][step]]
        assert 0 <= gap < 1e-3 * np.abs(scores).max(), (line, step, gap)


def test_a_converted_file_serves_its_blocks_without_parsing_the_gguf(block_file, monkeypatch):
    from decoders.checkpoints import gguf_cache, open_checkpoint
    from decoders.checkpoints.gguf import GGUFCheckpoint

    path = block_file("q4_1")
    open_checkpoint(path).close()                    # converted, if it was not already
    direct = GGUFCheckpoint(path)

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed")

    monkeypatch.setattr(gguf_cache, "GGUFCheckpoint", no_parsing)
    converted = open_checkpoint(path)
    assert isinstance(converted, gguf_cache.ConvertedGGUF)
    name = "model.layers.1.self_attn.k_proj.weight"       # rope rows restored to HF's order
    assert converted.block_form(name) == "q4_1" and converted.quant_type(name) == "Q4_1"
    assert (converted.block_form("model.norm.weight") is None
            and converted.quant_type("model.norm.weight") == "F32")
    for ours, theirs in zip(converted.blocks(name), direct.blocks(name)):
        assert ours == theirs if isinstance(ours, str) else np.array_equal(ours, theirs)
