"""Measure pyhlo against HF transformers and llama.cpp on the same weights.

Each engine runs in a process of its own (so memory peaks do not mix) and the engines
take turns: a warm-up generation each, then --repeats rounds in which every engine
generates once. Every generation is greedy with EOS ignored, so each line really gets
--new-tokens tokens. Reported per engine, precision and batch size:

  TTFT          time to first token: prefill of the prompt plus the first token
  decode tok/s  (new tokens - 1) / (total - TTFT), added up over the batch lines
  roofline      weight bytes / measured memory bandwidth = the least time a decode step
                can take; the share of it each engine reaches
  to_neuron     from_pretrained + to_neuron() wall time, cold (empty compile cache in a
                temporary directory) and warm (a second process, same cache)
  peak RSS      the process's high-water mark over loading and generating
  buckets       pyhlo ms per decode step while the length sits in each token bucket

The memory read bandwidth is measured in the same run, before the first configuration and
after each (threads summing parts of a large array, and a BLAS matrix-vector product over
it); the best measurement counts, as other processes only ever lower it. Before each
measured generation the bench waits for the CPUs to be idle (--quiet-wait), repeats a
generation (at most twice) when other processes took over 10% of the CPUs meanwhile, and
reports how much CPU they took. llama.cpp (llama-cpp-python) is used when it can be
imported; it reads F32, BF16 or Q8_0 GGUF files written from our dequantized weights and
cached next to the model, or, for gguf, the model's own file.

Precisions (--amp): f32 and bf16 run every weight in that type. s8 is int8 weights for the
linear products inside the decoder layers, in f32 models: pyhlo with
NeuronConfig(quant=QuantizationConfig(quant_dtype="s8")) (one scale per row), llama.cpp on a
Q8_0 GGUF of the same weights (one scale per 32 values), HF transformers with PyTorch's
dynamic int8 quantization (torch.ao.quantization.quantize_dynamic) of the layers' Linear
modules. Embeddings, LM head and norms stay f32 in all three. gguf is the GGUF model file
as it is stored (SmolLM2's: Q4_1 layers, Q8_0 embedding and LM head): pyhlo runs its blocks
as stored (NeuronConfig(gguf_blocks=True)), llama.cpp reads that very file; HF transformers
widens GGUF weights to f32 at load, so it has no row there. gguf-x8 is the same with pyhlo's
kernels rounding the activations to int8 per 32 values (NeuronConfig(int8_activations=True)),
as llama.cpp does. The other precisions widen a GGUF's weights at load (gguf_blocks=False)
and llama.cpp reads a file written from them.

Results: a markdown table on stdout, and DIR/bench.json, DIR/bench.md, DIR/bench.png
(worker logs in DIR/logs/).

examples:
  pyhlo bench                                  # everything, SmolLM2-135M-Instruct
  pyhlo bench --quick                          # a smoke run with tiny settings
  pyhlo bench --engines pyhlo,hf --amp bf16 --batch 1 --repeats 5 --no-compile-times
  pyhlo bench --amp s8,f32 --batch 1                # int8 weights beside f32
  pyhlo bench --amp gguf --batch 1                  # the GGUF file's Q4_1 blocks as stored
  pyhlo bench --amp gguf,gguf-x8 --batch 1          # ... and with int8 activations
  pyhlo bench --device cuda                         # on a GPU: pyhlo, HF eager, HF static cache + torch.compile
  pyhlo bench --device cpu --random-model tiny      # the same on the CPU, a tiny random model
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

from tools import bench_peers, bench_report
from tools.random_checkpoint import SHAPES as RANDOM_SHAPES

ENGINES = ("pyhlo", "hf", "llamacpp")
AMPS = ("f32", "bf16", "s8", "gguf", "gguf-x8")
ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULTS = dict(amp="f32,bf16,s8,gguf,gguf-x8", batch="1,4", prompt_tokens=128, new_tokens=128, repeats=3, n_positions=1024,
                bandwidth_mb=512)
QUICK = dict(amp="f32", batch="1", prompt_tokens=16, new_tokens=8, repeats=1, n_positions=256, bandwidth_mb=64)
BUCKET_PROMPT_TOKENS = 16
# Leading greedy tokens two engines must share in f32 before we call the weights the same.
AGREEMENT_TOKENS = 16
PROMPT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth for the great lens. From the gallery he could see the fishing boats returning "
    "to the harbour, their lamps swinging with the swell, and beyond them the dark line of the "
    "cliffs where the old signal station had stood before the storm of the winter of 1893. "
    "He kept a logbook in a careful hand: the direction of the wind, the height of the waves, "
    "the names of the ships that passed, and the hour at which the light was lit and put out. "
    "In spring the gulls nested on the rocks below, and the children from the village came to "
    "count the eggs and argue about which birds would fly first. In autumn the gales returned, "
    "and the keeper wrote less and watched more, listening to the glass rattle in its frame. "
    "Years later, when the light was automated and the keeper had moved to a cottage inland, "
    "people asked him whether he missed the sea. He said that he still woke at dusk."
)


# -- options -----------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engines", help="comma-separated, from pyhlo,hf,llamacpp (default: all available)")
    parser.add_argument("--amp", help="comma-separated precisions, from f32,bf16,s8,gguf,gguf-x8; s8: int8 weights "
                                      "in the decoder layers, the rest f32; gguf: a GGUF model's own quantized "
                                      "weights as stored; gguf-x8: the same with the activations of their products "
                                      f"rounded to int8 (default {DEFAULTS['amp']})")
    parser.add_argument("--batch", help=f"comma-separated batch sizes (default {DEFAULTS['batch']})")
    parser.add_argument("--prompt-tokens", type=int, help=f"prompt length (default {DEFAULTS['prompt_tokens']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated per line (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"measured rounds after the warm-up (default {DEFAULTS['repeats']})")
    parser.add_argument("--n-positions", type=int,
                        help=f"longest sequence pyhlo compiles for (default {DEFAULTS['n_positions']})")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for the peers and the bandwidth probe (default: all cores)")
    parser.add_argument("--out", default="bench_results", help="output directory (default bench_results/)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: f32, batch 1, 16-token prompt, 8 new tokens, n_positions 256, "
                             "1 repeat (options given explicitly still win)")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the cold compile into an empty cache; use the usual compile cache")
    parser.add_argument("--no-buckets", action="store_true", help="skip the per-bucket decode latency run")
    parser.add_argument("--serve", action="store_true",
                        help="instead: `pyhlo serve` against llama.cpp's server on the model's GGUF file, 1, 4 and "
                             "8 concurrent streaming clients (tools/bench_serve.py)")
    parser.add_argument("--serve-requests", type=int, default=24, metavar="N",
                        help="--serve: requests per concurrency level (default 24)")
    parser.add_argument("--speculative", type=int, metavar="K",
                        help="instead: speculative decoding's speed-up, k=K drafts a round: the model widened to "
                             "f32 as target, its GGUF blocks as stored as draft, greedy, 3 chat prompts "
                             "(tools/bench_speculative.py; --new-tokens, default 128)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="instead: pyhlo against HF transformers eager and HF with a static cache + "
                             "torch.compile on this device, with the share of the weight-copy floor each reaches; "
                             "random weights of Llama-3.2-1B's shape unless --model (tools/bench_device.py)")
    parser.add_argument("--random-model", choices=tuple(RANDOM_SHAPES),
                        help="--device: random weights of this shape (default llama-3.2-1b; tiny for tests)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="before each measured generation, wait up to this many seconds for other "
                             "processes to leave the CPUs idle, and repeat generations they disturbed "
                             "(default 60; 0: neither wait nor repeat)")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def resolve_settings(args: argparse.Namespace) -> dict:
    """The run's settings: explicit options, else --quick's, else the defaults; validated."""
    base = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name, None) is not None else base[name]  # noqa: E731
    settings = {name: pick(name) for name in ("amp", "batch", "prompt_tokens", "new_tokens", "repeats",
                                              "n_positions")}
    settings["bandwidth_mb"] = base["bandwidth_mb"]
    settings["amps"] = _csv(settings.pop("amp"))
    for amp in settings["amps"]:
        if amp not in AMPS:
            raise ValueError(f"--amp {amp!r} is not one of {', '.join(AMPS)}")
    try:
        settings["batches"] = [int(b) for b in _csv(settings.pop("batch"))]
    except ValueError as e:
        raise ValueError(f"--batch must be comma-separated integers ({e})") from None
    if not settings["amps"] or not settings["batches"] or min(settings["batches"]) < 1:
        raise ValueError("--amp and --batch need at least one value; batch sizes are >= 1")
    if settings["new_tokens"] < 2:
        raise ValueError("--new-tokens must be at least 2 (decode speed is measured after the first token)")
    if settings["prompt_tokens"] < 1 or settings["repeats"] < 1:
        raise ValueError("--prompt-tokens and --repeats must be at least 1")
    if settings["prompt_tokens"] + settings["new_tokens"] > settings["n_positions"]:
        raise ValueError(f"--prompt-tokens + --new-tokens ({settings['prompt_tokens'] + settings['new_tokens']}) "
                         f"exceeds --n-positions {settings['n_positions']}")
    settings["threads"] = max(1, args.threads)
    settings["compile_times"] = not args.no_compile_times
    settings["buckets"] = not args.no_buckets
    settings["quiet_wait"] = max(0.0, args.quiet_wait)
    return settings


def resolve_engines(requested: str | None) -> tuple[list[str], dict[str, str]]:
    """Engines to run, and the ones left out with the reason."""
    unavailable = {}
    why = bench_peers.llamacpp_available()
    if why:
        unavailable["llamacpp"] = why
    if requested is None:
        return [e for e in ENGINES if e not in unavailable], unavailable
    engines = _csv(requested)
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--engines {engine!r} is not one of {', '.join(ENGINES)}")
    return engines, {e: r for e, r in unavailable.items() if e in engines}


# -- the machine ---------------------------------------------------------------------
def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    import psutil

    cpu, flags = platform.processor() or "?", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu in ("?", platform.processor()):
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for package in ("numpy", "jaxlib", "torch", "transformers", "llama-cpp-python"):
        version = _version(package)
        if version:
            versions[package] = version
    return {
        "cpu": cpu, "cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "fma"}),
        "memory_gib": psutil.virtual_memory().total / 2**30, "platform": platform.platform(),
        "versions": versions,
    }


def measure_bandwidth(array_mb: int, threads: int, repeats: int = 7) -> dict:
    """Sustained memory read bandwidth over one large float32 array, two ways:

      threaded sum  `threads` threads each summing a part (numpy releases the GIL there);
      matvec        the array as a matrix times a vector through numpy's BLAS (its own
                    threads): the access pattern of a decode step.

    The faster median is the bandwidth the roofline uses.
    """
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(array_mb * 2**20 // 4, np.float32)
    parts = np.array_split(data, threads)
    columns = 4096 if data.size % 4096 == 0 else 1
    matrix, vector = data.reshape(-1, columns), np.ones(columns, np.float32)

    def rate(read) -> list[float]:
        samples = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            read()
            samples.append(data.nbytes / (time.perf_counter() - started) / 1e9)
        return samples[1:]  # the first pass warms the caches and the threads

    with ThreadPoolExecutor(threads) as pool:
        probes = {"threaded sum": rate(lambda: list(pool.map(np.sum, parts))),
                  "matvec": rate(lambda: matrix @ vector)}
    medians = {name: float(np.median(samples)) for name, samples in probes.items()}
    best = max(medians, key=medians.get)
    return {"gb_per_s": medians[best], "method": best, "samples_gb_per_s": probes[best],
            "probes_gb_per_s": medians, "array_mb": array_mb, "threads": threads}


def pyhlo_options(amp: str) -> dict:
    """from_pretrained() arguments of pyhlo's model at a bench precision."""
    from decoders import NeuronConfig, QuantizationConfig

    if amp == "s8":
        return {"amp": "f32", "neuron_config": NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"))}
    if amp in ("gguf", "gguf-x8"):
        return {"amp": "f32", "neuron_config": NeuronConfig(gguf_blocks=True, int8_activations=amp == "gguf-x8")}
    return {"amp": amp, "neuron_config": NeuronConfig(gguf_blocks=False)}


def weight_bytes(model_path: pathlib.Path, amp: str, n_positions: int) -> int:
    """Bytes of weights one decode step reads, from the parameters pyhlo declares at `amp`
    (each in the element type it is stored in: int8 and f32 scales for s8, a GGUF's blocks as
    stored for gguf): every layer's
    once per layer, the shared ones once. Embedding tables are left out (a step reads one row
    of each); a tied LM head is a linear weight and stays in."""
    from decoders import NeuronAutoModelForCausalLM
    from decoders.blocks.params import Kind
    from pyhlo.dtypes import byte_size

    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, n_positions=n_positions, **pyhlo_options(amp))
    builder = model.session.builder
    declared = [(p, builder.decoder.n_layers) for p in builder.layer_params()]
    declared += [(p, 1) for p in builder.shared_params()]
    return sum(math.prod(spec.dims) * byte_size(spec.dtype) * n
               for p, n in declared if p.kind is not Kind.TABLE or p.part_of for spec in [builder.spec(p)])


def make_prompts(model_path: pathlib.Path, batch: int, length: int) -> list[list[int]]:
    """`batch` different prompts of `length` tokens: windows of a fixed text, or, when the
    model has no tokenizer, fixed pseudo-random ids."""
    from decoders.checkpoints import open_checkpoint

    with open_checkpoint(model_path) as checkpoint:
        vocab = int(checkpoint.config["vocab_size"])
        try:
            ids = list(checkpoint.tokenizer()(PROMPT_TEXT)["input_ids"])
        except Exception:  # noqa: BLE001 - a checkpoint without tokenizer files
            ids = np.random.default_rng(0).integers(3, vocab, 256).tolist()
    need = length + 7 * batch
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[7 * i: 7 * i + length] for i in range(batch)]


# -- other processes -------------------------------------------------------------------
QUIET_PERCENT = 15.0  # system-wide CPU use (% of all cores) below which the machine counts as idle
DISTURBED = 0.10  # share of the machine other processes may take during a generation we keep
RETRIES = 2  # generations repeated at most this often when other processes disturbed them


def _system_busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    # guest time is already counted in user time; steal (the hypervisor's other guests) is not ours
    return (sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
            - getattr(t, "guest_nice", 0.0))


def _own_seconds() -> float:
    """CPU time of this process and of its finished (reaped) children."""
    own = os.times()
    return own.user + own.system + own.children_user + own.children_system


class OtherLoad:
    """How much CPU other processes take while we measure; waiting for them to stop.

    Timings on a shared machine are only as good as its quiet: a second process on one of
    two cores stalls every multi-threaded engine at each barrier. Other processes' use is
    the system's busy time minus ours: this process, its finished workers, and the worker
    that ran (it reports its own CPU time).
    """

    def __init__(self, max_wait: float):
        self.max_wait = max_wait
        self.busy_starts = 0
        self.retries = 0

    @staticmethod
    def mark() -> tuple[float, float, float]:
        return time.perf_counter(), _system_busy_seconds(), _own_seconds()

    @staticmethod
    def other_since(mark: tuple[float, float, float], worker_cpu_s: float = 0.0) -> dict:
        wall, busy, own = (b - a for a, b in zip(mark, OtherLoad.mark()))
        other = max(0.0, busy - own - worker_cpu_s)
        return {"other_cpu_seconds": other, "wall_seconds": wall,
                "other_cpu_fraction": other / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0}

    def start(self) -> None:
        self.busy_starts = self.retries = 0
        self._start = self.mark()

    def stop(self) -> dict:
        """Other processes' CPU use since start() (all workers reaped by then)."""
        return {**self.other_since(self._start), "busy_starts": self.busy_starts, "retries": self.retries}

    def wait(self) -> None:
        """Return once the CPUs are idle (our workers are idle between requests), or after max_wait."""
        import psutil

        if self.max_wait <= 0:
            return
        deadline = time.perf_counter() + self.max_wait
        while psutil.cpu_percent(interval=0.5) >= QUIET_PERCENT:
            if time.perf_counter() > deadline:
                self.busy_starts += 1
                return

    def generate(self, worker: Worker, prompts: list[list[int]], new_tokens: int) -> dict:
        """One generation on a quiet machine: repeated (at most RETRIES times) when other
        processes took more than DISTURBED of the CPUs meanwhile."""
        for attempt in range(RETRIES + 1):
            self.wait()
            mark = self.mark()
            record = worker.call("generate", prompts=prompts, new_tokens=new_tokens)
            record["other_cpu_fraction"] = self.other_since(mark, record["cpu_s"])["other_cpu_fraction"]
            if record["other_cpu_fraction"] <= DISTURBED or attempt == RETRIES or self.max_wait <= 0:
                return record
            self.retries += 1
        raise AssertionError("unreachable")


# -- workers -------------------------------------------------------------------------
class WorkerError(RuntimeError):
    pass


class Worker:
    """One engine in a child process, driven by JSON lines (`python -m tools.bench --worker`)."""

    def __init__(self, name: str, log_path: pathlib.Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        environment = dict(os.environ, TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + ([environment["PYTHONPATH"]] if environment.get("PYTHONPATH") else []))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.bench", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=environment)

    def call(self, op: str, **request: Any) -> Any:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise WorkerError(f"{self.name} worker exited with code {self.proc.returncode}: {self._log_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise WorkerError(f"{self.name}: {reply['error']}")
        return reply["result"]

    def _log_tail(self, lines: int = 5) -> str:
        self._log.flush()
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        return " | ".join(tail) or f"see {self.log_path}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PyhloRunner:
    """Ours: the family's *ForSampling, from_pretrained + to_neuron, then greedy sample()."""

    engine = "pyhlo"

    def __init__(self, model_path: str, amp: str, batch: int, n_positions: int, **_: Any):
        from decoders import NeuronAutoModelForCausalLM

        options = pyhlo_options(amp)
        self.model = NeuronAutoModelForCausalLM.from_pretrained(model_path, batch_size=batch,
                                                                n_positions=n_positions, **options)
        self.model.to_neuron()
        programs = self.model.programs
        self.info = {"programs": len(self.model.eager_programs()), "cache_hits": programs.cache_hits,
                     "compiler_calls": programs.compiler_calls,
                     "token_buckets": self.model.token_buckets, "context_buckets": self.model.context_buckets}
        lowering = self.model.lowering
        if lowering.quant is not None:
            self.info["quant"] = lowering.quant.to_dict()
        if lowering.gguf_blocks:
            self.info["gguf_blocks"] = dict(lowering.gguf_blocks)
        if hasattr(lowering, "kernel_rows"):
            self.info["kernel_rows"] = dict(lowering.kernel_rows)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        streamer = bench_peers.TimingStreamer()
        length = len(prompts[0])
        started = time.perf_counter()
        out = self.model.sample(prompts, sequence_length=length + new_tokens, top_k=1, eos_token_id=[],
                                streamer=streamer)
        finished = time.perf_counter()
        return bench_peers.generation_record(started, streamer.token_times(started), finished,
                                             out[:, length:].tolist())


RUNNERS = {"pyhlo": PyhloRunner, "hf": bench_peers.HFRunner, "hf-compiled": bench_peers.HFCompiledRunner,
           "llamacpp": bench_peers.LlamaCppRunner}
# Imported before the load clock starts: library import time is not load time.
PRELOAD = {"pyhlo": ("decoders", "jax"), "hf": ("torch", "transformers"), "hf-compiled": ("torch", "transformers"),
           "llamacpp": ("llama_cpp",)}


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark.

    /proc's VmHWM belongs to the process's own address space. getrusage's ru_maxrss is no
    good in a worker: Linux carries the parent's peak into it across fork and exec.
    """
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def worker_main() -> int:
    """The child side of Worker: one request per stdin line, one JSON reply per line."""
    import psutil

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not into the replies
    sys.stdout = sys.stderr
    runner = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            if op == "load":
                for module in PRELOAD[request["engine"]]:
                    importlib.import_module(module)
                started = time.perf_counter()
                runner = RUNNERS[request["engine"]](**request)
                result = {"seconds": time.perf_counter() - started, "info": runner.info}
            elif op == "generate":
                cpu = os.times()
                result = runner.generate(request["prompts"], request["new_tokens"])
                done = os.times()
                result["cpu_s"] = done.user + done.system - cpu.user - cpu.system
            elif op == "memory":
                result = {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": psutil.Process().memory_info().rss}
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as error:  # noqa: BLE001 - reported to the parent, which goes on
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


# -- one configuration ---------------------------------------------------------------
def new_row(engine: str, amp: str, batch: int) -> dict:
    return {"engine": engine, "amp": amp, "batch": batch, "status": "ok", "error": None,
            "ttft_ms": None, "decode_tokens_per_s": None, "ms_per_step": None, "load_s": None,
            "compile_cold_s": None, "compile_warm_s": None, "peak_rss_mb": None, "rss_mb": None,
            "cold_peak_rss_mb": None, "roofline_fraction": None, "vs": {}, "ttft_vs": {}, "agreement": None,
            "other_cpu_fraction": [], "disturbed_samples": 0, "info": {}, "warmup_s": None, "total_s": None,
            "tokens": None}


def _fail(row: dict, error: Exception) -> None:
    row["status"], row["error"] = "error", str(error)
    print(f"  {row['engine']} {row['amp']} batch {row['batch']}: {error}", file=sys.stderr)


def measure_config(model_path: pathlib.Path, engines: list[str], amp: str, batch: int, settings: dict,
                   prompts: list[list[int]], model_files: dict[str, pathlib.Path], logs: pathlib.Path,
                   load: OtherLoad, env: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    """Rows of every engine for one precision and batch size, and pyhlo's bucket rows.
    `env`: environment variables for every worker."""
    rows = {e: new_row(e, amp, batch) for e in engines}
    tag = f"{amp}-b{batch}"
    spec = {"amp": amp, "batch": batch, "n_positions": settings["n_positions"], "threads": settings["threads"],
            "prompt_tokens": settings["prompt_tokens"], "device": settings.get("device", "cpu")}
    new_tokens = settings["new_tokens"]
    cache_env: dict[str, str] = dict(env or {})
    cache_dir = None
    buckets: list[dict] = []
    if settings["compile_times"] and "pyhlo" in rows:
        cache_dir = tempfile.mkdtemp(prefix="pyhlo-bench-cache-")
        cache_env = {"PYHLO_CACHE_DIR": cache_dir}
        print(f"[{tag}] pyhlo: cold to_neuron() into an empty compile cache", file=sys.stderr)
        try:
            with Worker("pyhlo", logs / f"pyhlo-{tag}-cold.log", cache_env) as worker:
                loaded = worker.call("load", engine="pyhlo", model_path=str(model_path), **spec)
                memory = worker.call("memory")
            rows["pyhlo"]["compile_cold_s"] = loaded["seconds"]
            rows["pyhlo"]["cold_peak_rss_mb"] = memory["peak_rss_bytes"] / 2**20
        except WorkerError as error:
            _fail(rows["pyhlo"], error)
    workers: dict[str, Worker] = {}
    try:
        for engine, row in rows.items():
            if row["status"] != "ok":
                continue
            print(f"[{tag}] {engine}: loading", file=sys.stderr)
            worker = Worker(engine, logs / f"{engine}-{tag}.log", cache_env if engine == "pyhlo" else env)
            workers[engine] = worker
            try:
                loaded = worker.call("load", engine=engine, model_path=str(model_files[engine]), **spec)
            except WorkerError as error:
                _fail(row, error)
                continue
            row["load_s"], row["info"] = loaded["seconds"], loaded["info"]
            if engine == "pyhlo" and cache_dir is not None:
                row["compile_warm_s"] = loaded["seconds"]
        live = [e for e in rows if rows[e]["status"] == "ok"]
        warm_tokens: dict[str, list[list[int]]] = {}
        records: dict[str, list[dict]] = {e: [] for e in live}
        for engine in list(live):
            try:
                warm = workers[engine].call("generate", prompts=prompts, new_tokens=new_tokens)
                warm_tokens[engine] = rows[engine]["tokens"] = warm["tokens"]
                rows[engine]["warmup_s"] = warm["total_s"]
            except WorkerError as error:
                _fail(rows[engine], error)
                live.remove(engine)
        for round_ in range(settings["repeats"]):
            print(f"[{tag}] round {round_ + 1}/{settings['repeats']}", file=sys.stderr)
            turn = round_ % max(1, len(live))
            for engine in live[turn:] + live[:turn]:  # who goes first rotates
                if rows[engine]["status"] != "ok":
                    continue
                try:
                    records[engine].append(load.generate(workers[engine], prompts, new_tokens))
                except WorkerError as error:
                    _fail(rows[engine], error)
        for engine in live:
            row = rows[engine]
            if row["status"] == "ok":
                summarize_records(row, records[engine], new_tokens, batch)
                if "pyhlo" in warm_tokens and engine != "pyhlo" and engine in warm_tokens:
                    row["agreement"] = {"reference": "pyhlo", "new_tokens": new_tokens, "matching_new_tokens": [
                        bench_report.matching_prefix(a, b) for a, b in zip(warm_tokens[engine], warm_tokens["pyhlo"])]}
        if settings["buckets"] and "pyhlo" in live and rows["pyhlo"]["status"] == "ok":
            buckets = measure_buckets(workers["pyhlo"], rows["pyhlo"], prompts, settings, tag, load)
        for engine, worker in workers.items():
            if worker.proc.poll() is None:
                try:
                    memory = worker.call("memory")
                    rows[engine]["peak_rss_mb"] = memory["peak_rss_bytes"] / 2**20
                    rows[engine]["rss_mb"] = memory["rss_bytes"] / 2**20
                except WorkerError:
                    pass
    finally:
        for worker in workers.values():
            worker.close()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return list(rows.values()), buckets


def summarize_records(row: dict, records: list[dict], new_tokens: int, batch: int) -> None:
    metrics = [bench_report.decode_metrics(r["ttft_s"], r["total_s"], new_tokens, batch) for r in records]
    row["ttft_ms"] = bench_report.summarize(m["ttft_ms"] for m in metrics)
    row["decode_tokens_per_s"] = bench_report.summarize(m["tokens_per_s"] for m in metrics)
    row["ms_per_step"] = bench_report.summarize(m["ms_per_step"] for m in metrics)
    row["total_s"] = bench_report.summarize(r["total_s"] for r in records)
    others = [r.get("other_cpu_fraction", 0.0) for r in records]
    row["other_cpu_fraction"] = others
    row["disturbed_samples"] = sum(o > DISTURBED for o in others)


def measure_buckets(worker: Worker, row: dict, prompts: list[list[int]], settings: dict, tag: str,
                    load: OtherLoad) -> list[dict]:
    """One long generation from a short prompt up to n_positions; each step's time goes to the
    token bucket it ran in."""
    buckets = row["info"]["token_buckets"]
    prompt_length = max(1, min(BUCKET_PROMPT_TOKENS, buckets[0] // 2, settings["prompt_tokens"]))
    new_tokens = settings["n_positions"] - prompt_length
    print(f"[{tag}] pyhlo: {new_tokens} decode steps across buckets {buckets}", file=sys.stderr)
    try:
        record = load.generate(worker, [p[:prompt_length] for p in prompts], new_tokens)
    except WorkerError as error:
        print(f"  bucket run failed: {error}", file=sys.stderr)
        return []
    times = record["token_times_s"]
    step_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    rows = bench_report.bucket_rows(step_ms, prompt_length, buckets)
    return [{"amp": row["amp"], "batch": row["batch"], **r, "other_cpu_fraction": record["other_cpu_fraction"]}
            for r in rows]


# -- the whole run -------------------------------------------------------------------
LLAMACPP_WITHOUT_AMX = ("CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                        "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                        "-DGGML_AMX_BF16=OFF\" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")


def notes_for(results: list[dict], settings: dict) -> list[str]:
    """Things a reader should not miss: disagreeing tokens, precisions slower than expected."""
    notes = []
    need = min(AGREEMENT_TOKENS, settings["new_tokens"])
    by_key = {(r["engine"], r["amp"], r["batch"]): r for r in results if r["status"] == "ok"}

    def agreeing(row: dict | None) -> int | None:
        return min(row["agreement"]["matching_new_tokens"]) if row and row.get("agreement") else None

    for (engine, amp, batch), row in by_key.items():
        same = agreeing(row)
        if amp != "f32" or same is None or same >= need:
            continue
        label = bench_report.ENGINE_LABELS.get(engine, engine)
        single = agreeing(by_key.get((engine, amp, 1)))
        if batch > 1 and single is not None and single >= need:
            notes.append(f"{label} f32 batch {batch}: greedy tokens part from pyhlo's after {same} (worst line) "
                         f"while batch 1 agrees for {single}: its batched kernels round differently and a "
                         "near-tie flips")
        else:
            notes.append(f"{label} f32 batch {batch}: only {same} leading greedy tokens equal pyhlo's "
                         f"(expected >= {need}); are the weights the same?")
    fewer_bytes = {"bf16": "half the weight bytes", "s8": "int8 layer weights"}
    for (engine, amp, batch), row in by_key.items():
        f32 = by_key.get((engine, "f32", batch))
        if amp in fewer_bytes and f32 is not None:
            fast = bench_report.median_of(f32["decode_tokens_per_s"])
            slow = bench_report.median_of(row["decode_tokens_per_s"])
            if fast and slow and slow < 0.9 * fast:
                notes.append(f"{bench_report.ENGINE_LABELS.get(engine, engine)} batch {batch}: {amp} decodes at "
                             f"{slow:.1f} tok/s, f32 at {fast:.1f} tok/s ({fast / slow:.2f}x slower in {amp}, "
                             f"although it reads {fewer_bytes[amp]})")
    crashed = [r for r in results if r["engine"] == "llamacpp" and "code -11" in str(r.get("error", ""))]
    if crashed and "amx_int8" in machine_info().get("cpu_flags", ()):
        notes.append("llama.cpp crashed (SIGSEGV) on this CPU: a llama-cpp-python built with -march=native runs "
                     "its AMX int8 kernels for prompts of 2 or more tokens, and they fault here. Build it without "
                     "them: " + LLAMACPP_WITHOUT_AMX)
    for row in results:
        if row.get("disturbed_samples"):
            notes.append(f"{bench_report.ENGINE_LABELS.get(row['engine'], row['engine'])} {row['amp']} batch "
                         f"{row['batch']}: {row['disturbed_samples']} of {len(row['other_cpu_fraction'])} samples ran "
                         f"while other processes took over {DISTURBED:.0%} of the CPUs (after {RETRIES} retries)")
        if (row.get("roofline_fraction") or 0) > 1.0:
            notes.append(f"{bench_report.ENGINE_LABELS.get(row['engine'], row['engine'])} {row['amp']} batch "
                         f"{row['batch']} beats the roofline ({row['roofline_fraction'] * 100:.0f}%): the "
                         "bandwidth probes read slower than the engine did")
    for row in results:
        if row["status"] != "ok":
            notes.append(f"{row['engine']} {row['amp']} batch {row['batch']}: {row['status']}: {row['error']}")
    return notes


def busy_notes(busy: list[dict]) -> list[str]:
    return [f"{b['amp']} batch {b['batch']}: {b['busy_starts']} generations started while other processes "
            f"kept the CPUs busy (after waiting --quiet-wait seconds)" for b in busy if b["busy_starts"]]


def run_serve(args: argparse.Namespace) -> int:
    from tools import bench_serve

    model_path = _default_or_given_model(args)
    if model_path.suffix != ".gguf":
        raise ValueError("--serve compares with llama.cpp's server, which reads .gguf models: give a .gguf --model")
    engines, unavailable = resolve_engines(args.engines or "pyhlo,llamacpp")
    engines = [e for e in engines if e != "hf" and e not in unavailable]
    out = pathlib.Path(args.out)
    rows = bench_serve.measure(model_path, engines, [1, 4, 8], args.serve_requests, args.new_tokens or 64,
                               args.threads, out)
    info = machine_info()
    text = (f"Serving: {model_path.name} as stored, {args.serve_requests} chat requests per level, "
            f"max_tokens {args.new_tokens or 64}, greedy, streamed; pyhlo serve with 8 lines; "
            f"CPU {info.get('cpu')}, {args.threads} threads\n\n" + bench_serve.table(rows))
    for engine, why in unavailable.items():
        text += f"\n\n{engine} left out: {why}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.md").write_text(text + "\n")
    (out / "serve.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


def _default_or_given_model(args: argparse.Namespace) -> pathlib.Path:
    if args.model:
        return pathlib.Path(args.model)
    from decoders.checkpoints.default_model import default_model_path

    return default_model_path()


def run_speculative(args: argparse.Namespace) -> int:
    from tools import bench_speculative

    model_path = _default_or_given_model(args)
    if model_path.suffix != ".gguf":
        raise ValueError("--speculative drafts with the model's GGUF blocks as stored: give a .gguf --model")
    if args.speculative < 1:
        raise ValueError(f"--speculative K needs K >= 1, got {args.speculative}")
    result = bench_speculative.measure(model_path, args.speculative, args.new_tokens or 128)
    info = machine_info()
    text = (f"Speculative decoding: target {model_path.name} widened to f32, draft the same file's blocks as "
            f"stored, k={result['k']}, greedy, {result['new_tokens']} new tokens; "
            f"{result['tokens_per_target_call']:.2f} tokens per target call; "
            f"CPU {info.get('cpu')}, {args.threads} threads\n\n" + bench_speculative.table(result))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.md").write_text(text + "\n")
    (out / "speculative.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0 if result["all_same_tokens"] else 1


def run(args: argparse.Namespace) -> int:
    if args.device is not None:
        from tools import bench_device

        return bench_device.run(args)
    if args.random_model:
        raise ValueError("--random-model belongs to the device benchmark: add --device cpu or --device cuda")
    if args.serve:
        return run_serve(args)
    if args.speculative is not None:
        return run_speculative(args)
    settings = resolve_settings(args)
    engines, unavailable = resolve_engines(args.engines)
    if args.model:
        model_path = pathlib.Path(args.model)
        if not model_path.exists():
            raise FileNotFoundError(f"--model {args.model}: no such file or directory")
    else:
        from decoders.checkpoints.default_model import default_model_path

        model_path = default_model_path()
    out = pathlib.Path(args.out)
    logs = out / "logs"
    notes = [f"{e} left out: {why}" for e, why in unavailable.items() if e not in engines]
    if "llamacpp" in engines and "llamacpp" not in unavailable and model_path.suffix != ".gguf":
        unavailable["llamacpp"] = "llama.cpp reads .gguf models only"

    load = OtherLoad(settings["quiet_wait"])

    def probe_bandwidth() -> None:
        load.wait()
        probes.append(measure_bandwidth(settings["bandwidth_mb"], settings["threads"]))

    print("measuring memory bandwidth ...", file=sys.stderr)
    probes: list[dict] = []
    probe_bandwidth()
    prompts_all = make_prompts(model_path, max(settings["batches"]), settings["prompt_tokens"])

    results: list[dict] = []
    buckets: list[dict] = []
    busy: list[dict] = []
    for amp in settings["amps"]:
        model_files = {"pyhlo": model_path, "hf": model_path}
        missing = dict(unavailable)
        if amp in ("gguf", "gguf-x8"):
            missing.setdefault("hf", "HF transformers widens GGUF weights to f32 at load: no row as stored")
            if model_path.suffix != ".gguf":
                raise ValueError(f"--amp gguf runs a GGUF model's weights as stored; {model_path} is not a .gguf")
            model_files["llamacpp"] = model_path
        elif "llamacpp" in engines and "llamacpp" not in unavailable:
            print(f"{bench_peers.GGUF_KINDS[amp][0]} GGUF for llama.cpp ...", file=sys.stderr)
            model_files["llamacpp"] = bench_peers.peer_gguf(model_path, amp)
        for batch in settings["batches"]:
            runnable = [e for e in engines if e not in missing]
            load.start()
            rows, bucket_list = measure_config(model_path, runnable, amp, batch, settings, prompts_all[:batch],
                                               model_files, logs, load)
            busy.append({"amp": amp, "batch": batch, **load.stop()})
            for engine in engines:
                if engine in missing:
                    rows.append({**new_row(engine, amp, batch), "status": "unavailable",
                                 "error": missing[engine]})
            results += rows
            buckets += bucket_list
            probe_bandwidth()
    # Other processes only ever lower a probe: the best one is the machine's bandwidth.
    bandwidth = dict(max(probes, key=lambda b: b["gb_per_s"]), all_probes_gb_per_s=[b["gb_per_s"] for b in probes])
    roofline = {}
    for amp in settings["amps"]:
        size = weight_bytes(model_path, amp, settings["n_positions"])
        least = bench_report.roofline_ms(size, bandwidth["gb_per_s"] * 1e9)
        roofline[amp] = {"weight_bytes": size, "min_ms_per_step": least, "max_tokens_per_s_batch1": 1e3 / least}
    bench_report.add_roofline_fractions(results, {amp: r["weight_bytes"] for amp, r in roofline.items()},
                                        bandwidth["gb_per_s"] * 1e9)
    bench_report.add_comparisons(results)
    report = {
        "schema": bench_report.SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "workload": {"model": model_path.name, "prompt_tokens": settings["prompt_tokens"],
                     "new_tokens": settings["new_tokens"], "repeats": settings["repeats"],
                     "n_positions": settings["n_positions"], "threads": settings["threads"],
                     "engines": engines, "amps": settings["amps"], "batches": settings["batches"],
                     "quick": bool(args.quick)},
        "bandwidth": bandwidth,
        "roofline": roofline,
        "results": results,
        "buckets": buckets,
        "other_load": busy,
        "notes": notes + notes_for(results, settings) + busy_notes(busy),
    }
    paths = bench_report.write_all(report, out)
    print(bench_report.report_markdown(report))
    print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("this module is the bench worker; run `pyhlo bench` instead")
    sys.exit(worker_main())
