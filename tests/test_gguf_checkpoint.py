"""Reading GGUF files: Hugging Face names, shapes, config and tokenizer, checked against
Hugging Face transformers' own GGUF loader on the same file."""

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from decoders.checkpoints import CheckpointError, open_checkpoint
from decoders.checkpoints.gguf import GGUFCheckpoint, unpermute_rope_rows

Q = gguf.GGMLQuantizationType



@pytest.fixture(autouse=True)
def _read_the_gguf_itself(monkeypatch):
    """These tests are about reading GGUF files: no converted copies (see test_gguf_cache.py)."""
    monkeypatch.setenv("PYHLO_GGUF_CACHE", "0")

def llama_cpp_permute(weight, n_heads):
    """What llama.cpp's converter does to q and k: pair rows (i, i + head_dim/2) become adjacent."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@given(
    n_heads=st.integers(1, 4),
    half_head_dim=st.integers(1, 5),
    cols=st.sampled_from([(), (1,), (3,)]),
)
def test_unpermute_inverts_llama_cpp_permute(n_heads, half_head_dim, cols):
    w = np.arange(n_heads * 2 * half_head_dim * int(np.prod(cols)), dtype=np.float32)
    w = w.reshape(n_heads * 2 * half_head_dim, *cols)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, n_heads), n_heads), w)


def test_unpermute_by_hand():
    # One head of 4 rows: llama.cpp stores HF rows 0,2,1,3 (rotary pairs (0,2) and (1,3) adjacent).
    stored = np.array([0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rope_rows(stored, 1), [0, 1, 2, 3])


# A tiny Llama written as GGUF by the test, as llama.cpp's converter would.

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Stored types other than F32, to cover dequantization, and q/k permutation after it.
STORED_AS = {
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.Q8_0,
    "blk.1.attn_k.weight": Q.F16,
    "blk.0.ffn_up.weight": Q.BF16,
}


def gguf_name(hf_name):
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, inner = base.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[inner]}.{suffix}"
    return f"{GGUF_NAMES[base]}.{suffix}"


def write_tiny_gguf(path, state, arch="llama", metadata=None, extra_tensors=()):
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_rope_dimension_count(TINY["hidden_size"] // TINY["num_attention_heads"])
    writer.add_vocab_size(TINY["vocab_size"])
    writer.add_bos_token_id(TINY["bos_token_id"])
    writer.add_eos_token_id(TINY["eos_token_id"])
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for add in metadata or ():
        add(writer)
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        w = tensor.numpy()
        if ".attn_q." in name:
            w = llama_cpp_permute(w, TINY["num_attention_heads"])
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, TINY["num_key_value_heads"])
        kind = STORED_AS.get(name, Q.F32)
        if kind == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif kind == Q.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    for name, value in extra_tensors:
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored_value(name, w):
    """What a tensor becomes once stored as STORED_AS says (before any permutation)."""
    kind = STORED_AS.get(name, Q.F32)
    if kind == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    if kind == Q.F32:
        return w
    return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_state():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    return model.state_dict()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_state, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny_state)


def test_tiny_gguf_gives_back_the_model_tensors(tiny_state, tiny_gguf):
    with open_checkpoint(tiny_gguf) as ckpt:
        assert isinstance(ckpt, GGUFCheckpoint)
        assert sorted(ckpt.names()) == sorted(tiny_state)
        for name, tensor in tiny_state.items():
            w = tensor.numpy()
            got = ckpt.get(name)
            assert got.dtype == np.float32
            assert ckpt.shape(name) == got.shape == w.shape
            if ckpt.quant_type(name) in ("F32", "F16", "BF16"):
                # Lossless storage: exact, so the permutation must be exactly undone.
                np.testing.assert_array_equal(got, stored_value(gguf_name(name), w), err_msg=name)
            else:
                np.testing.assert_allclose(got, w, atol=0.02, err_msg=name)


def test_tiny_gguf_keep_dtype(tiny_gguf):
    with open_checkpoint(tiny_gguf) as ckpt:
        assert ckpt.get("model.layers.1.self_attn.k_proj.weight", keep_dtype=True).dtype == np.float16
        assert ckpt.get("model.layers.0.mlp.up_proj.weight", keep_dtype=True).dtype.name == "bfloat16"
        # Quantized tensors have no dtype to keep: they dequantize to float32.
        assert ckpt.get("model.layers.0.mlp.down_proj.weight", keep_dtype=True).dtype == np.float32


def test_tiny_gguf_matches_transformers_loader(tiny_gguf):
    """Quantized tensors too: the same dequantization and un-permutation as transformers."""
    reference = hf_gguf_tensors(tiny_gguf)
    with open_checkpoint(tiny_gguf) as ckpt:
        assert sorted(ckpt.names()) == sorted(reference)
        for name, tensor in reference.items():
            np.testing.assert_array_equal(ckpt.get(name), tensor.numpy(), err_msg=name)


def test_tiny_gguf_config(tiny_gguf):
    with open_checkpoint(tiny_gguf) as ckpt:
        config = ckpt.config
        assert ckpt.chat_template() == "{{ messages[0]['content'] }}"
    for key, value in TINY.items():
        if key != "rms_norm_eps":
            assert config[key] == value, key
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["head_dim"] == 16
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is False and config["mlp_bias"] is False
    assert config["rope_scaling"] is None
    # The config builds the matching HF model.
    LlamaConfig(**config)


def test_tied_embeddings_and_rope_scaling(tiny_state, tmp_path):
    state = {k: v for k, v in tiny_state.items() if k != "lm_head.weight"}
    metadata = [
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
        lambda w: w.add_rope_scaling_factor(4.0),
    ]
    with open_checkpoint(write_tiny_gguf(tmp_path / "tied.gguf", state, metadata=metadata)) as ckpt:
        assert ckpt.config["tie_word_embeddings"] is True
        assert "lm_head.weight" not in ckpt.names()
        assert ckpt.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
        assert ckpt.config["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}


def test_directory_with_one_gguf_opens_it(tiny_gguf):
    with open_checkpoint(tiny_gguf.parent) as ckpt:
        assert ckpt.path == tiny_gguf


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", {}, arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported; supported: .*llama"):
        open_checkpoint(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not gguf at all")
    with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file"):
        open_checkpoint(path)


def test_rope_frequency_tensor_is_refused(tiny_state, tmp_path):
    extra = [("rope_freqs.weight", np.ones(8, np.float32))]
    path = write_tiny_gguf(tmp_path / "llama31.gguf", tiny_state, extra_tensors=extra)
    with pytest.raises(CheckpointError, match="rope_freqs.weight: per-dimension RoPE frequency factors"):
        open_checkpoint(path)


def test_unknown_tensor_is_named(tiny_state, tmp_path):
    extra = [("blk.0.attn_mystery.weight", np.ones(8, np.float32))]
    path = write_tiny_gguf(tmp_path / "odd.gguf", tiny_state, extra_tensors=extra)
    with pytest.raises(CheckpointError, match="'blk.0.attn_mystery.weight' has no known Hugging Face name"):
        open_checkpoint(path)


def test_gguf_without_tokenizer(tiny_gguf):
    with open_checkpoint(tiny_gguf) as ckpt:
        with pytest.raises(CheckpointError, match="no tokenizer"):
            ckpt.tokenizer()


def test_closed_checkpoint_says_so(tiny_gguf):
    ckpt = open_checkpoint(tiny_gguf)
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.get("model.norm.weight")


# The real model, against transformers loading the same file.


def hf_gguf_tensors(path):
    """Tensors as transformers' GGUF loader produces them (what from_pretrained(gguf_file=) loads
    for Llama; from_pretrained itself also wants the accelerate package)."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    return loaded["tensors"]


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    with open_checkpoint(smollm2_gguf) as ckpt:
        yield ckpt


@pytest.fixture(scope="session")
def hf_smollm2_tensors(smollm2_gguf):
    return hf_gguf_tensors(smollm2_gguf)


def test_real_model_tensors_match_transformers(smollm2, hf_smollm2_tensors):
    # Tied embeddings: no output.weight in the file, so no lm_head.weight on either side.
    assert sorted(smollm2.names()) == sorted(hf_smollm2_tensors)
    assert len(smollm2.names()) == 272
    for name, tensor in hf_smollm2_tensors.items():
        ours = smollm2.get(name)
        assert ours.dtype == np.float32 and smollm2.shape(name) == ours.shape == tuple(tensor.shape)
        np.testing.assert_allclose(ours, tensor.numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_real_model_config_matches_transformers(smollm2, smollm2_gguf):
    ours = smollm2.config
    theirs = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours["rope_scaling"] is None
    assert (ours["num_hidden_layers"], ours["num_attention_heads"], ours["num_key_value_heads"]) == (30, 9, 3)


def test_real_model_tokenizer_and_chat_template(smollm2, smollm2_gguf):
    ours = smollm2.tokenizer()
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = ours("Hello, world")["input_ids"]
    assert ids == theirs("Hello, world")["input_ids"] == [19556, 28, 905]
    template = smollm2.chat_template()
    assert "<|im_start|>" in template
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")
