"""`pyhlo bench --device cpu|cuda`: pyhlo against HF transformers on one device, and the share
of the memory-bandwidth floor each reaches.

Engines, each in a worker process of its own, taking turns as in `pyhlo bench` (rounds.py):

  pyhlo        the family's *ForSampling on the device (its worker runs with PYHLO_PLATFORM set
               to the device), greedy sample()
  hf           HF transformers' eager model and generate() on the torch device
  hf-compiled  HF generate() with a static KV cache and each decode step compiled by torch.compile
               (mode "reduce-overhead", i.e. CUDA graphs, on a GPU; inductor's "default" on a CPU)

Per precision and batch size, median of --repeats rounds after a warm-up generation:

  TTFT          prefill of the prompt plus the first token
  decode tok/s  (new tokens - 1) / (total - TTFT), added up over the batch lines
  % of floor    the floor is the time a decode step needs to read every weight once at the
                device's measured bandwidth (a GPU: a 1 GiB device-to-device torch copy, bytes
                read + written per second; a CPU: the read probes of machine.py); floor ms = weight
                bytes / bandwidth, % of floor = floor ms / measured ms per step
  compile s     pyhlo: from_pretrained + to_neuron() into an empty compile cache (every program
                compiled); hf-compiled: the warm-up generation's time over a measured one's
                (tracing, inductor's compile into an empty cache, CUDA-graph capture)

The model is random weights of Llama-3.2-1B's shape in bf16 (tools/random_checkpoint.py),
written once into the model cache, or an HF directory (--model); prompts are random token
ids from a fixed seed, so no tokenizer is needed. When the device is missing for torch or
for jax, the run stops at once and names what to install: nothing falls back to the CPU.

Precision (--amp): bf16 by default on a GPU, f32 on a CPU; f32 is where the engines' greedy
tokens must agree. Batch sizes 1 and 8, a 128-token prompt and 128 new tokens unless told.

Results: a markdown table on stdout, DIR/bench_device.json and DIR/bench_device.md (worker
logs in DIR/logs/).

examples:
  pyhlo bench --device cuda                                  # bf16, batch 1 and 8
  pyhlo bench --device cuda --amp f32,bf16 --batch 1,8,32 --model ~/models/Llama-3.2-1B
  pyhlo bench --device cpu --random-model tiny --batch 1,2 --new-tokens 6
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

from tools.bench import machine, report
from tools.bench.rounds import measure_config
from tools.bench.settings import DEFAULTS, QUICK
from tools.bench.settings import resolve_settings as resolve_common_settings
from tools.bench.worker import ROOT
from tools.random_checkpoint import random_checkpoint

ENGINES = ("pyhlo", "hf", "hf-compiled")
AMPS = ("f32", "bf16")
DEFAULT_AMP = {"cuda": "bf16", "cpu": "f32"}
DEFAULT_BATCHES = "1,8"
DEFAULT_RANDOM_MODEL = "llama-3.2-1b"
ELEMENT_BYTES = {"f32": 4, "bf16": 2}
PROMPT_SEED = 0


def resolve_settings(args: argparse.Namespace) -> dict:
    """The CPU benchmark's settings with this benchmark's defaults: amp by device, batch sizes 1 and 8,
    n_positions just long enough for the prompt and the new tokens; no bucket run."""
    device = args.device
    given = copy.copy(args)
    given.amp = args.amp or DEFAULT_AMP[device]
    given.batch = args.batch or (None if args.quick else DEFAULT_BATCHES)
    base = QUICK if args.quick else DEFAULTS
    longest = (args.prompt_tokens or base["prompt_tokens"]) + (args.new_tokens or base["new_tokens"])
    given.n_positions = args.n_positions or longest
    settings = resolve_common_settings(given)
    for amp in settings["amps"]:
        if amp not in AMPS:
            raise ValueError(f"--device runs --amp {', '.join(AMPS)}, not {amp!r}")
    settings.update(device=device, buckets=False)
    return settings


def resolve_engines(requested: str | None) -> list[str]:
    engines = [e.strip() for e in (requested or ",".join(ENGINES)).split(",") if e.strip()]
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--device runs the engines {', '.join(ENGINES)}, not {engine!r}")
    return engines


def resolve_model(args: argparse.Namespace) -> tuple[pathlib.Path, str]:
    """The HF directory every engine reads, and how to name it in the report."""
    if args.model and args.random_model:
        raise ValueError("give --model or --random-model, not both")
    if args.model:
        path = pathlib.Path(args.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {args.model}: not an HF model directory (no config.json)")
        return path, path.name
    shape = args.random_model or DEFAULT_RANDOM_MODEL
    print(f"random {shape} weights ...", file=sys.stderr)
    return random_checkpoint(shape), f"{shape} (random weights, bf16 checkpoint)"


def weight_bytes(model_path: pathlib.Path, amp: str) -> int:
    """Bytes a decode step reads when every weight is read once at `amp`: all parameters but the
    token embedding, which a step reads one row of, unless it is also the (tied) LM head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    count = sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())
    return count * ELEMENT_BYTES[amp]


def random_prompts(model_path: pathlib.Path, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` token ids drawn from a fixed seed."""
    import json

    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    return np.random.default_rng(PROMPT_SEED).integers(3, vocab, (batch, length)).tolist()


def worker_environment(device: str) -> dict[str, str]:
    """What every worker needs to run on `device`: pyhlo's platform, and on a GPU a jax that takes
    memory as it needs it (by default it would claim most of the GPU, which the HF workers share)."""
    env = {"PYHLO_PLATFORM": device}
    if device == "cuda":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def compile_seconds(row: dict) -> float | None:
    """pyhlo: its cold to_neuron(); hf-compiled: what the warm-up generation took beyond a measured one."""
    if row["status"] != "ok":
        return None
    if row["engine"] == "pyhlo":
        return row["compile_cold_s"]
    if row["engine"] == "hf-compiled" and row["warmup_s"] is not None and row["total_s"]:
        return max(0.0, row["warmup_s"] - row["total_s"]["median"])
    return None


def machine_of(device: str) -> dict:
    """machine_info() with the device and its name."""
    info = {"device": device, "device_name": machine.device_name(device), **machine.machine_info()}
    if device == "cuda":
        import torch

        info["versions"]["cuda (torch)"] = torch.version.cuda
    return info


def run(args: argparse.Namespace) -> int:
    """Measure every precision and batch size on the device; print the report and write its files."""
    device = args.device
    settings = resolve_settings(args)
    engines = resolve_engines(args.engines)
    machine.check_device(device, str(ROOT))
    model_path, model_name = resolve_model(args)
    out = pathlib.Path(args.out)
    logs = out / "logs"
    print(f"measuring {device} memory bandwidth ...", file=sys.stderr)
    bandwidth = machine.measure_device_bandwidth(device, settings["threads"], settings["bandwidth_mb"])
    prompts_all = random_prompts(model_path, max(settings["batches"]), settings["prompt_tokens"])
    env = worker_environment(device)
    load = machine.OtherLoad(settings["quiet_wait"])
    results: list[dict] = []
    busy: list[dict] = []
    for amp in settings["amps"]:
        for batch in settings["batches"]:
            # torch.compile's cache starts empty too, when compile times are measured.
            inductor_cache = (tempfile.mkdtemp(prefix="pyhlo-bench-inductor-") if settings["compile_times"]
                              else None)
            config_env = dict(env, **({"TORCHINDUCTOR_CACHE_DIR": inductor_cache} if inductor_cache else {}))
            load.start()
            try:
                rows, _ = measure_config(model_path, engines, amp, batch, settings, prompts_all[:batch],
                                         {e: model_path for e in engines}, logs, load, config_env)
            finally:
                if inductor_cache:
                    shutil.rmtree(inductor_cache, ignore_errors=True)
            busy.append({"amp": amp, "batch": batch, **load.stop()})
            results += rows
    sizes = {amp: weight_bytes(model_path, amp) for amp in settings["amps"]}
    for row in results:
        row["compile_s"] = compile_seconds(row)
    workload = {"model": model_name, "device": device, "prompt_tokens": settings["prompt_tokens"],
                "new_tokens": settings["new_tokens"], "repeats": settings["repeats"],
                "n_positions": settings["n_positions"], "threads": settings["threads"], "engines": engines,
                "amps": settings["amps"], "batches": settings["batches"]}
    full_report = report.assemble(report.DEVICE_SCHEMA, machine_of(device), workload, bandwidth, sizes,
                                  results, busy, settings)
    paths = report.write_all(full_report, out)
    print(report.markdown(full_report))
    print(f"wrote {paths['json']}, {paths['md']}", file=sys.stderr)
    return 0
