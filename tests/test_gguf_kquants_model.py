"""GGUF weights kept in Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and IQ4_NL blocks (the forms of
llama.cpp's Q4_K_M, Q5_K_M, Q6_K and IQ4_NL files) compute the same function as the same file
widened to f32 at load: a tiny Llama whose rows are whole 256-value super-blocks, every matrix
in one form, or in a mix of forms as llama.cpp's Q4_K_M writes them (rows of mixed forms); the
converted copy of such a file keeps each tensor once."""
from __future__ import annotations

import logging

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

FORMS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl")


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
            made[name] = write_gguf(path, model, state, "llama", weights_type=kind, vocabulary=True)
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
    if kernels:    # a decode step's products and a prompt's run on the form's own kernels
        from decoders.programs.keys import Block
        from runtime import cpu_kernels

        prompt_kernel = "pyhlo_gemm" if cpu_kernels.exact_gemm_is_fast() else "pyhlo_matvec"
        for key, kernel in ((Block(1, 128), "pyhlo_matvec"), (Block(64, 128), prompt_kernel)):
            module = kept.programs.build(key).module
            targets = {i.custom_call_target for c in module.computations for i in c.instructions}
            assert f"{kernel}_{form}" in targets, key

    prompts = [np.arange(3, 40) % 300 + 3, np.arange(90, 101)]
    tokens, logits = kept.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = widened.sample(prompts, sequence_length=100, top_k=1, eos_token_id=[],
                                               output_scores=True)
    for step in range(len(logits)):
        assert relative_error(logits[step], expected_logits[step]) < 1e-5, step
    np.testing.assert_array_equal(tokens, expected)


def q4_k_m_like(name: str):
    """Types as llama.cpp's Q4_K_M mixes them for a model whose rows are not all whole
    super-blocks: ffn_down Q6_K in some layers and Q4_K in others, attn_v Q8_0 or Q5_0, the
    other attention weights Q5_0, the token table and the head Q6_K."""
    kinds = gguf.GGMLQuantizationType
    if name.startswith(("token_embd", "output")):
        return kinds.Q6_K
    layer = int(name.split(".")[1])
    if ".ffn_down." in name:
        return kinds.Q6_K if layer == 0 else kinds.Q4_K
    if ".attn_v." in name:
        return kinds.Q8_0 if layer == 0 else kinds.Q5_0
    return kinds.Q5_0 if ".attn_" in name else kinds.Q4_K


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=pytest.mark.cpu_only), False],
                         ids=["cpu_kernels", "xla_dot"])
def test_a_q4_k_m_mix_keeps_every_weight_as_stored(kquant_file, kernels, caplog):
    """Weights whose types differ between layers (the down projection Q6_K and Q4_K; the fused
    q|k|v Q5_0 with a Q8_0 or Q5_0 v) keep each row in its own form: nothing is widened."""
    path = kquant_file("q4_k_m", q4_k_m_like)
    with caplog.at_level(logging.INFO, logger="pyhlo"):
        kept = build(path, None, kernels, batch_size=1)
    forms = dict(kept.lowering.gguf_blocks)
    assert forms == {"attn.out.weight": "q5_0", "lm_head.weight": "q6_k", "mlp.gate_up.weight": "q4_k",
                     "attn.qkv.weight": "rows:q5_0+q8_0", "mlp.down.weight": "rows:q4_k+q6_k"}
    # One line, each type once, and the room the rows of mixed forms leave unused.
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF linear weights")]
    for kind in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        assert line.count(kind) == 1, (kind, line)
    assert "widened" not in line and "MB unused" in line
    if kernels:                  # a decode step's products run on the kernel of mixed rows
        from decoders.programs.keys import Block

        module = kept.programs.build(Block(1, 128)).module
        targets = {i.custom_call_target for c in module.computations for i in c.instructions}
        assert "pyhlo_matvec_gguf_rows" in targets

    widened = build(path, False, False, batch_size=1)
    prompt = np.arange(5, 40)[None]
    tokens, logits = kept.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = widened.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[],
                                               output_scores=True)
    for step in range(len(logits)):
        assert relative_error(logits[step], expected_logits[step]) < 1e-5, step
    np.testing.assert_array_equal(tokens, expected)


def test_types_that_cannot_be_kept_are_widened_with_their_cost(kquant_file, caplog):
    """A tensor of a type pyhlo does not keep (TQ2_0, ternary, among Q4_K ones) leaves its
    weight widened to the amp type, and the line says so and what it costs."""
    kinds = gguf.GGMLQuantizationType
    path = kquant_file("q4_k_tq", lambda name: kinds.TQ2_0 if ".ffn_up." in name else kinds.Q4_K)
    with caplog.at_level(logging.INFO, logger="pyhlo"):
        kept = build(path, None, None, batch_size=1, amp="bf16")
    assert "mlp.gate_up.weight" not in dict(kept.lowering.gguf_blocks)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF linear weights")]
    assert "TQ2_0 x2 widened to bf16 (not kept as stored)" in line
    assert "MB more than the file's blocks" in line


def test_the_converted_copy_keeps_each_tensor_once(kquant_file, tmp_path, monkeypatch):
    """Tensors in a form pyhlo keeps are stored as their blocks only, not also widened to f32;
    a later open widens them from those when asked, equal to the file's own reading."""
    from safetensors import safe_open

    from decoders.checkpoints import open_checkpoint
    from decoders.checkpoints.gguf import GGUFCheckpoint
    from decoders.checkpoints.gguf_cache import BLOCKS, ConvertedGGUF, converted_dir

    monkeypatch.setenv("PYHLO_GGUF_CACHE", str(tmp_path))
    path = kquant_file("q4_k_m", q4_k_m_like)
    first = GGUFCheckpoint(path)                 # the file itself
    open_checkpoint(path)                        # converts it, then reads the copy
    second = open_checkpoint(path)
    assert isinstance(second, ConvertedGGUF)
    folder = converted_dir(path)
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as widened:
        assert sorted(widened.keys()) == sorted(n for n in first.names() if first.block_form(n) is None)
        assert all(first.quant_type(n) == "F32" for n in widened.keys())     # only the norms are left
    with safe_open(str(folder / BLOCKS), framework="numpy") as blocks:
        kept_bytes = sum(blocks.get_tensor(k).nbytes for k in blocks.keys())
    assert sum(f.stat().st_size for f in folder.iterdir()) < 1.2 * path.stat().st_size
    assert kept_bytes < path.stat().st_size
    assert sorted(second.names()) == sorted(first.names())
    for name in first.names():
        assert second.shape(name) == first.shape(name)
        assert second.block_form(name) == first.block_form(name)
        np.testing.assert_array_equal(second.get(name), first.get(name))


def test_int8_activations_need_weights_kept_in_blocks(kquant_file):
    with pytest.raises(ValueError, match="this model has neither"):
        LlamaForSampling.from_pretrained(kquant_file("f32", lambda name: None), n_positions=128,
                                         neuron_config=NeuronConfig(int8_activations=True))


def k_quants_and_q5_0(name: str):
    """K-quants as llama.cpp's Q4_K_M mixes them (ffn_down Q6_K in one layer, Q4_K in the other;
    the head Q6_K), the q|k|v projections Q5_K and attn_output Q5_0."""
    kinds = gguf.GGMLQuantizationType
    if name.startswith(("token_embd", "output")):
        return kinds.Q6_K
    if ".ffn_down." in name:
        return kinds.Q6_K if int(name.split(".")[1]) == 0 else kinds.Q4_K
    if ".attn_output." in name:
        return kinds.Q5_0
    return kinds.Q5_K if ".attn_" in name else kinds.Q4_K


def int8_model(path):
    """The GGUF file's blocks as stored on the CPU kernels, activations rounded to int8."""
    return LlamaForSampling.from_pretrained(
        path, batch_size=1, n_positions=128, context_length_estimate=[16, 64],
        neuron_config=NeuronConfig(gguf_blocks=True, cpu_kernels=True, int8_activations=True)).to_neuron()


def decode_kernel_targets(model) -> set[str]:
    """The custom calls of a decode step's programs (a layer block and the LM head)."""
    from decoders.programs.keys import Block, LMHead

    return {i.custom_call_target for key in (Block(1, 128), LMHead(1))
            for c in model.programs.build(key).module.computations for i in c.instructions}


@pytest.mark.cpu_only
def test_int8_activations_round_the_k_quant_products(kquant_file):
    """NeuronConfig(int8_activations=True): the decode products of K-quant weights, rows of mixed
    K-quants too, run the _x8 kernels (activations rounded as llama.cpp's Q8_K rounds them), a
    Q5_0 weight its own (per 32, as llama.cpp's Q8_0); the logits stay within the rounding's
    reach of the exact ones."""
    path = kquant_file("k_quants_q5_0", k_quants_and_q5_0)
    exact = build(path, True, True, batch_size=1)
    rounded = int8_model(path)
    assert dict(rounded.lowering.gguf_blocks) == {
        "attn.qkv.weight": "q5_k", "attn.out.weight": "q5_0", "mlp.gate_up.weight": "q4_k",
        "mlp.down.weight": "rows:q4_k+q6_k", "lm_head.weight": "q6_k"}
    targets = decode_kernel_targets(rounded)
    assert {"pyhlo_matvec_q4_k_x8", "pyhlo_matvec_q5_k_x8", "pyhlo_matvec_q6_k_x8",
            "pyhlo_matvec_gguf_rows_x8", "pyhlo_matvec_q5_0_x8"} <= targets
    assert not {"pyhlo_matvec_q4_k", "pyhlo_matvec_q5_k", "pyhlo_matvec_q6_k", "pyhlo_matvec_q5_0",
                "pyhlo_matvec_gguf_rows"} & targets
    prompt = np.arange(5, 30)[None]
    _, logits = rounded.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    _, expected = exact.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    # Per 256 values the rounding step is that of the largest of 256 activations (Q8_0's, of 32):
    # measured 0.7% at the prompt's token, 2-5% at the decode steps of this random model.
    for step in range(4):                                # the prompt's token, decode steps
        assert 1e-7 < relative_error(logits[step], expected[step]) < 8e-2, step


@pytest.mark.cpu_only
def test_int8_activations_round_every_product_of_a_q4_k_m_mix(kquant_file):
    """A file in the types llama.cpp's Q4_K_M gives a model whose rows are not all whole
    super-blocks (q|k|v rows Q5_0 with a Q8_0 or Q5_0 v, attn_output Q5_0, ffn_down Q6_K and
    Q4_K): in int8 mode every decode product runs an integer kernel, none an exact one, and
    the logits stay within the rounding's reach of the exact ones."""
    from runtime.cpu_kernels import MATVEC_GGUF_ROWS_TARGET, MATVEC_GGUF_TARGETS

    path = kquant_file("q4_k_m", q4_k_m_like)
    exact = build(path, True, True, batch_size=1)
    rounded = int8_model(path)
    assert dict(rounded.lowering.gguf_blocks) == {
        "attn.out.weight": "q5_0", "lm_head.weight": "q6_k", "mlp.gate_up.weight": "q4_k",
        "attn.qkv.weight": "rows:q5_0+q8_0", "mlp.down.weight": "rows:q4_k+q6_k"}
    targets = decode_kernel_targets(rounded)
    assert {"pyhlo_matvec_q5_0_x8", "pyhlo_matvec_q4_k_x8", "pyhlo_matvec_q6_k_x8",
            "pyhlo_matvec_gguf_rows_x8"} <= targets
    assert not {*MATVEC_GGUF_TARGETS.values(), MATVEC_GGUF_ROWS_TARGET} & targets
    prompt = np.arange(5, 30)[None]
    _, logits = rounded.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    _, expected = exact.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    for step in range(4):                                # the prompt's token, decode steps
        assert 1e-7 < relative_error(logits[step], expected[step]) < 8e-2, step


def test_a_q4_k_m_file_from_llama_cpps_quantizer_loads_and_answers(kquant_file, tmp_path):
    """llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, the .[llamacpp]
    extra) makes a Q4_K_M file of the tiny f32 model: its K-quant weights run as stored and
    answer the greedy tokens of the same file widened at load."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]'); it writes "
        "the Q4_K_M file this test loads")
    import ctypes

    source = kquant_file("f32", lambda name: None)
    target = tmp_path / "tiny.Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    done = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert done == 0
    kept, widened = build(target, None, None, batch_size=1), build(target, False, False, batch_size=1)
    assert "q4_k" in dict(kept.lowering.gguf_blocks).values()
    prompt = np.arange(5, 40)[None]
    tokens, logits = kept.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = widened.sample(prompt, sequence_length=60, top_k=1, eos_token_id=[],
                                               output_scores=True)
    assert relative_error(logits[0], expected_logits[0]) < 1e-5
    np.testing.assert_array_equal(tokens, expected)


@pytest.mark.slow
def test_smollm2_as_q4_k_m_keeps_its_blocks_and_answers_the_widened_tokens(smollm2_gguf, tmp_path):
    """SmolLM2-135M (rows of 576 values: not whole super-blocks) made Q4_K_M by llama.cpp's
    quantizer from its Q4_1 file: Q4_K, Q6_K, Q5_0 and Q8_0 tensors, types differing between
    layers, all kept as stored. Greedy tokens of 2 prompts equal the widened file's, up to a
    near-tie of its logits."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]'); it writes "
        "the Q4_K_M file this test loads")
    import ctypes

    from test_gguf_blocks import first_divergence

    target = tmp_path / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    source = str(smollm2_gguf).encode()
    assert llama_cpp.llama_model_quantize(source, str(target).encode(), ctypes.byref(params)) == 0
    models = [LlamaForSampling.from_pretrained(target, batch_size=2, n_positions=256,
                                               context_length_estimate=[64],
                                               neuron_config=NeuronConfig(gguf_blocks=kept))
              for kept in (True, False)]
    kept, widened = (m.to_neuron() for m in models)
    forms = set(dict(kept.lowering.gguf_blocks).values())
    assert any(f.startswith("rows:") or f == "q4_k" for f in forms) and "q6_k" in "".join(forms)
    texts = ["The history of the printing press begins", "Photosynthesis is the process by which"]
    prompt = np.array([(kept.tokenizer(text)["input_ids"] * 64)[:64] for text in texts])
    tokens, _ = kept.sample(prompt, sequence_length=112, top_k=1, eos_token_id=[], output_scores=True)
    expected, scores = widened.sample(prompt, sequence_length=112, top_k=1, eos_token_id=[],
                                      output_scores=True)
    for line in range(2):
        step = first_divergence(np.asarray(tokens[line]), np.asarray(expected[line]))
        if step is not None:
            logits = np.asarray(scores[step - prompt.shape[1]][line])
            gap = logits[expected[line][step]] - logits[tokens[line][step]]
            assert 0 <= gap < 1e-3 * np.abs(logits).max(), (line, step, gap)


@pytest.mark.slow
def test_smollm2_in_q4_k_m_types_keeps_them_as_stored_and_answers_the_widened_tokens(smollm2_gguf, tmp_path):
    """SmolLM2-135M's file written again with the types llama.cpp's Q4_K_M gives it (Q5_0 x166,
    Q4_K x16, Q6_K x14, Q8_0 x15; by this file's own quantizer, where llama.cpp is not at hand):
    every weight kept as stored, the greedy tokens of 2 prompts equal the widened file's, up to
    a near-tie of its logits."""
    from collections import Counter

    from gguf_kquants import q4_k_m_types, rewrite
    from test_gguf_blocks import first_divergence

    target = tmp_path / "SmolLM2-135M-Instruct.q4_k_m_types.gguf"
    rewrite(smollm2_gguf, target, q4_k_m_types(30))
    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(target).tensors)
    assert (types["Q5_0"], types["Q4_K"], types["Q6_K"], types["Q8_0"]) == (166, 16, 14, 15)
    models = [LlamaForSampling.from_pretrained(target, batch_size=2, n_positions=256,
                                               context_length_estimate=[64],
                                               neuron_config=NeuronConfig(gguf_blocks=kept))
              for kept in (None, False)]
    kept, widened = (m.to_neuron() for m in models)
    assert dict(kept.lowering.gguf_blocks) == {
        "attn.qkv.weight": "rows:q5_0+q8_0", "attn.out.weight": "q5_0", "mlp.gate_up.weight": "q5_0",
        "mlp.down.weight": "rows:q4_k+q6_k", "lm_head.weight": "q8_0"}
    texts = ["The history of the printing press begins", "Photosynthesis is the process by which"]
    prompt = np.array([(kept.tokenizer(text)["input_ids"] * 64)[:64] for text in texts])
    tokens, _ = kept.sample(prompt, sequence_length=112, top_k=1, eos_token_id=[], output_scores=True)
    expected, scores = widened.sample(prompt, sequence_length=112, top_k=1, eos_token_id=[],
                                      output_scores=True)
    for line in range(2):
        step = first_divergence(np.asarray(tokens[line]), np.asarray(expected[line]))
        if step is not None:
            logits = np.asarray(scores[step - prompt.shape[1]][line])
            gap = logits[expected[line][step]] - logits[tokens[line][step]]
            assert 0 <= gap < 1e-3 * np.abs(logits).max(), (line, step, gap)


# Each int8 GEMM over a GGUF file's bytes: the file's types, the lowering's switch for it, the
# runtime.cpu_kernels test of its fast form, how the lowering keeps the weights that take it,
# and the targets a prompt takes with it and without.
INT8_GEMMS = {
    "k_quants": ("k_quants_q5_0", "k_quant_int8_gemm", "k_quant_int8_gemm_is_fast", {},
                 {"pyhlo_gemm_q4_k_x8", "pyhlo_gemm_q5_k_x8", "pyhlo_gemm_gguf_rows_x8"},
                 {"pyhlo_matvec_q4_k_x8", "pyhlo_matvec_q5_k_x8", "pyhlo_matvec_gguf_rows_x8"}),
    "32_value_blocks": ("q4_k_m_like", "int8_gemm", "int8_gemm_is_fast",
                        {"attn.qkv.weight": "rows:q5_0+q8_0"},
                        {"pyhlo_gemm_q5_0_x8", "pyhlo_gemm_gguf_rows32_x8"},
                        {"pyhlo_matvec_q5_0_x8", "pyhlo_matvec_gguf_rows_x8"}),
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("gemm_kind", list(INT8_GEMMS))
def test_a_prompt_on_an_int8_gemm_answers_as_on_the_matvec_kernel(kquant_file, monkeypatch, gemm_kind):
    """Where an int8 GEMM has a fast form (AVX-512 VNNI, AVX2), a prompt's products of its forms
    run it: the K-quants' (Q4_K, Q5_K, rows of mixed Q4_K and Q6_K), and the block forms' over
    the file's bytes (Q5_0, and the q|k|v rows of mixed Q5_0 and Q8_0 of a Q4_K_M file of a
    model whose rows are not whole super-blocks). Each has the same integer sums as the int8
    matrix-vector kernel that runs them without it: the logits of the prompt and of the decode
    steps after it (which read the keys and values it wrote) equal the kernel's up to f32
    summation order."""
    from decoders.programs.keys import Block
    from runtime import cpu_kernels

    types, switch, is_fast, kept_as, with_gemm, without = INT8_GEMMS[gemm_kind]
    if not getattr(cpu_kernels, is_fast)():
        pytest.skip("the int8 GEMMs need AVX-512 VNNI or AVX2, which this CPU lacks")
    # Both models take the program's own attention. The two products' sums differ in f32 order
    # (about 1e-7), and after attention the context is rounded to int8 again: a difference that
    # small can move one value across a rounding step, and in a random model that moved the
    # logits by 1.6 % with the prefill attention kernel (which matches the program's attention
    # to 1.3e-6 on the K-quant file in exact mode), where the program's attention happened to
    # move none. What this test compares is the products, so attention is held to one form.
    monkeypatch.setattr(cpu_kernels, "prefill_attention_is_fast", lambda: False)
    path = kquant_file(types, {"k_quants_q5_0": k_quants_and_q5_0, "q4_k_m_like": q4_k_m_like}[types])
    gemm = int8_model(path)
    for weight, form in kept_as.items():
        assert dict(gemm.lowering.gguf_blocks)[weight] == form
    prefill = {i.custom_call_target for c in gemm.programs.build(Block(64, 128)).module.computations
               for i in c.instructions}
    assert with_gemm <= prefill and not without & prefill
    monkeypatch.setattr(cpu_kernels, is_fast, lambda: False)
    matvec = int8_model(path)
    assert not getattr(matvec.lowering, switch)
    prompt = np.arange(5, 30)[None]
    tokens, logits = gemm.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[], output_scores=True)
    expected, expected_logits = matvec.sample(prompt, sequence_length=40, top_k=1, eos_token_id=[],
                                              output_scores=True)
    for step in range(len(logits)):
        assert relative_error(logits[step], expected_logits[step]) < 1e-5, step
    np.testing.assert_array_equal(tokens, expected)
