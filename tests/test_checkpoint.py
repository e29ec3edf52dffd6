"""Opening Hugging Face checkpoints: every layout yields the model's exact tensors and config."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoders.checkpoints import CheckpointError, MissingTensorError, open_checkpoint

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=5000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)


def make_tiny_llama(tie_word_embeddings=False, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tie_word_embeddings)).eval()


def save_torch_bin(model, directory, shards=1):
    """Write the PyTorch .bin layout (transformers 5 only writes safetensors now)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n].clone() for n in names[i::shards]}
        torch.save(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def save(model, directory, layout):
    if layout == "safetensors":
        model.save_pretrained(directory)
    elif layout == "sharded safetensors":
        model.save_pretrained(directory, max_shard_size="60KB")
        assert (directory / "model.safetensors.index.json").is_file()
    elif layout == "bin":
        save_torch_bin(model, directory)
    elif layout == "sharded bin":
        save_torch_bin(model, directory, shards=3)
    return directory


LAYOUTS = ["safetensors", "sharded safetensors", "bin", "sharded bin"]


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_tensor_equals_the_model_state_dict(model, tmp_path, layout):
    state = model.state_dict()
    with open_checkpoint(save(model, tmp_path / "m", layout)) as ckpt:
        assert sorted(ckpt.names()) == sorted(state)
        for name in ckpt.names():
            array = ckpt.get(name)
            assert array.dtype == np.float32
            assert ckpt.shape(name) == array.shape == tuple(state[name].shape)
            np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_is_config_json(model, tmp_path, layout):
    with open_checkpoint(save(model, tmp_path / "m", layout)) as ckpt:
        config = ckpt.config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert config[key] == CONFIG[key]
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["rms_norm_eps"] == 1e-5
    # transformers 5 writes theta under rope_parameters.
    assert config["rope_parameters"]["rope_theta"] == 5000.0
    assert config["tie_word_embeddings"] is False


def test_tied_embeddings_store_no_lm_head(tmp_path):
    """With tied embeddings names() lists what the file stores: no lm_head.weight.
    The model code reuses model.embed_tokens.weight, as config["tie_word_embeddings"] says."""
    model = make_tiny_llama(tie_word_embeddings=True)
    with open_checkpoint(save(model, tmp_path / "m", "safetensors")) as ckpt:
        assert ckpt.config["tie_word_embeddings"] is True
        assert "lm_head.weight" not in ckpt
        assert sorted(ckpt.names()) == sorted(set(model.state_dict()) - {"lm_head.weight"})
        np.testing.assert_array_equal(
            ckpt.get("model.embed_tokens.weight"), model.state_dict()["lm_head.weight"].numpy()
        )


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_bfloat16_round_trips_exactly(tmp_path, layout):
    model = make_tiny_llama().to(torch.bfloat16)
    with open_checkpoint(save(model, tmp_path / "m", layout)) as ckpt:
        for name, tensor in model.state_dict().items():
            kept = ckpt.get(name, keep_dtype=True)
            assert kept.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(
                kept.view(np.uint16), tensor.view(torch.int16).numpy().view(np.uint16)
            )
            widened = ckpt.get(name)
            assert widened.dtype == np.float32
            np.testing.assert_array_equal(widened, tensor.float().numpy())


def test_check_shape(model, tmp_path):
    with open_checkpoint(save(model, tmp_path / "m", "safetensors")) as ckpt:
        ckpt.check_shape("model.layers.0.self_attn.k_proj.weight", (32, 64))
        with pytest.raises(ValueError) as info:
            ckpt.check_shape("model.layers.0.self_attn.k_proj.weight", [64, 64])
    assert (
        str(info.value)
        == "model.layers.0.self_attn.k_proj.weight: expected shape (64, 64), checkpoint has (32, 64)"
    )


def test_tokenizer_and_chat_template(model, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    directory = save(model, tmp_path / "m", "safetensors")
    tokenizer.save_pretrained(directory)
    with open_checkpoint(directory) as ckpt:
        assert ckpt.tokenizer()("hello world there")["input_ids"] == [1, 2, 0]
        assert ckpt.chat_template() == tokenizer.chat_template


# Errors: each says what is wrong and what to do.


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory.*config.json.*.gguf"):
        open_checkpoint(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(tmp_path)


def test_no_weights_lists_what_was_looked_for(model, tmp_path):
    model.config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    message = str(info.value)
    assert "no weights file" in message
    for name in (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ):
        assert name in message


@pytest.mark.parametrize("layout", ["sharded safetensors", "sharded bin"])
def test_index_naming_a_missing_shard(model, tmp_path, layout):
    directory = save(model, tmp_path / "m", layout)
    index = next(directory.glob("*.index.json"))
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[1]
    (directory / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{shard}"):
        open_checkpoint(directory)


@pytest.mark.parametrize("layout", ["safetensors", "sharded bin"])
def test_missing_tensor_is_named(model, tmp_path, layout):
    with open_checkpoint(save(model, tmp_path / "m", layout)) as ckpt:
        with pytest.raises(MissingTensorError) as info:
            ckpt.get("model.layers.7.self_attn.q_proj.weight")
    error = info.value
    assert isinstance(error, ValueError) and isinstance(error, KeyError)
    assert "'model.layers.7.self_attn.q_proj.weight' is not in the checkpoint" in str(error)
    assert ".safetensors" in str(error) or ".bin" in str(error)


def test_unsupported_file_type(tmp_path):
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="unsupported checkpoint file type '.onnx'.*.gguf"):
        open_checkpoint(onnx)


def test_a_weights_file_asks_for_its_directory(model, tmp_path):
    directory = save(model, tmp_path / "m", "safetensors")
    with pytest.raises(CheckpointError, match="pass the directory"):
        open_checkpoint(directory / "model.safetensors")


def test_no_tokenizer(model, tmp_path):
    with open_checkpoint(save(model, tmp_path / "m", "safetensors")) as ckpt:
        with pytest.raises(CheckpointError, match="no tokenizer files; looked for tokenizer.json"):
            ckpt.tokenizer()


def test_several_gguf_files_need_a_choice(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match="several .gguf files.*a.gguf, b.gguf"):
        open_checkpoint(tmp_path)
