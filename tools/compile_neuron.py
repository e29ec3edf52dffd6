"""Write a model's programs for AWS's Neuron compiler (neuronx-cc), with the commands that compile them.

MODEL is an HF checkpoint directory, a .gguf file, or `default` (SmolLM2-135M-Instruct).
Every program model.eager_programs() lists is built as the neuronx-cc backend receives it
(plain HLO, one decoder-block program that every layer reuses): for each prefill (context)
bucket and each decode (token) bucket the embedding, the decoder block and the LM head, plus
the greedy sampler. --dump DIR then holds:

  NAME.pb         the serialized HloModuleProto, byte for byte as the library built it
  compile.sh      one neuronx-cc command per program; it cds into DIR, so run it from anywhere
  manifest.json   per program: name, .pb file, sha256 of the .pb, .neff file, num_replicas
                  (= --tp-degree), target, parameter and output names in order, and the
                  command as an argv list (paths relative to DIR, where each command runs)

Each command is the one the neuronx-cc backend (get_backend("neuronx-cc")) builds:

  neuronx-cc compile --framework XLA NAME.pb --target TARGET --output NAME.neff [NEURON_CC_FLAGS]

Compiler options go in NEURON_CC_FLAGS, which is read now and written into every command
(setting it later on the Neuron host does not change compile.sh), e.g.
"--model-type transformer", "--auto-cast none" or "-O1" (see `neuronx-cc compile --help`).

Compiling:
  here, without neuronx-cc   dump, copy DIR to a Neuron host (trn1, inf2 or trn2 with the Neuron
                             SDK's compiler installed) and run `bash DIR/compile.sh`
  with neuronx-cc on PATH    add --compile: the commands run in parallel (--jobs) with a
                             progress bar and write NAME.neff (and NAME.compile.log) into DIR

Tensor parallelism: --tp-degree N builds programs replicated over N NeuronCores, each with
its share of the weights and the all-reduces inside (a model whose heads do not split N ways,
or a build without tensor parallelism, is refused with the reason). Each program still
compiles into one NEFF; the Neuron runtime loads it on N cores
(num_replicas in the manifest), so the process that runs it needs N cores:
NEURON_RT_NUM_CORES=N, or NEURON_RT_VISIBLE_CORES=a-b for a range of N cores. Models that
share an instance take disjoint ranges, e.g. NEURON_RT_VISIBLE_CORES=0-7 and =8-15.

Not written: the weights (they are program parameters, given at run time). Nothing here runs
a NEFF: that needs the Neuron runtime on a Neuron host, through AWS's libneuronxla PJRT
plugin (PYHLO_PLATFORM=neuron).

examples:
  pyhlo compile default --target inf2 --dump out/smollm2-inf2
  pyhlo compile path/to/llama --target trn1 --amp bf16 --n-positions 2048 --dump out/llama-trn1
  NEURON_CC_FLAGS="--model-type transformer -O1" pyhlo compile default --target trn2 --dump out/smollm2-trn2
  pyhlo compile path/to/llama --target trn1 --tp-degree 8 --amp bf16 --dump out/llama-tp8
  bash out/smollm2-inf2/compile.sh                                      # later, on a Neuron host
  pyhlo compile default --target inf2 --dump out/smollm2-inf2 --compile  # where neuronx-cc is installed
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from runtime.neuronx_cc import COMPILER, INSTALL_HINT, TARGETS, NeuronCCBackend, compiler_path
from tools import hlo_report
from tools.model_options import add_model_arguments

SCRIPT = "compile.sh"
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class DumpedProgram:
    name: str
    pb: str
    sha256: str
    neff: str
    num_replicas: int
    target: str
    command: list[str]
    parameters: list[str]
    outputs: list[str]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model directory or .gguf file, or `default`")
    parser.add_argument("--target", choices=TARGETS, default=None,
                        help="Neuron instance family to compile for (default: $NEURON_TARGET, else trn1)")
    parser.add_argument("--tp-degree", type=int, default=1, metavar="N",
                        help="tensor-parallel degree: programs replicated over N NeuronCores (default 1)")
    parser.add_argument("--dump", required=True, metavar="DIR",
                        help="where NAME.pb, compile.sh and manifest.json are written")
    parser.add_argument("--compile", action="store_true",
                        help="also run the neuronx-cc commands (needs neuronx-cc on PATH)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                        help="with --compile: commands run at once (default: 4, or fewer CPUs)")
    model = parser.add_argument_group("model")
    add_model_arguments(model)


def open_model(args: argparse.Namespace, backend: NeuronCCBackend) -> Any:
    """The model as the neuronx-cc backend would compile it."""
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path
    from tools.model_options import weight_options

    target = hlo_report.parse_target(args.model)
    if target.kind != "model":
        raise ValueError(f"{args.model}: not a model; MODEL is a checkpoint directory, a .gguf file or "
                         "'default'")
    path = target.path if target.path is not None else default_model_path()
    return NeuronAutoModelForCausalLM.from_pretrained(
        path, batch_size=args.batch_size, n_positions=args.n_positions, tp_degree=args.tp_degree,
        amp=args.amp, context_length_estimate=args.context_length_estimate, backend=backend,
        neuron_config=NeuronConfig(**weight_options(args)))


def dump_programs(model: Any, directory: pathlib.Path, backend: NeuronCCBackend,
                  num_replicas: int) -> list[DumpedProgram]:
    """Build every program of model.eager_programs(), write NAME.pb and return what was written."""
    directory.mkdir(parents=True, exist_ok=True)
    dumped: list[DumpedProgram] = []
    for key in model.eager_programs():
        program = model.programs.build(key)
        module_bytes = program.module.SerializeToString()
        stem = hlo_report.file_stem(program.name)
        if any(d.pb == f"{stem}.pb" for d in dumped):
            raise ValueError(f"two programs would both be written to {stem}.pb")
        pb, neff = f"{stem}.pb", f"{stem}.neff"
        (directory / pb).write_bytes(module_bytes)
        dumped.append(DumpedProgram(
            name=program.name, pb=pb, sha256=hashlib.sha256(module_bytes).hexdigest(), neff=neff,
            num_replicas=num_replicas, target=backend.target,
            # Paths relative to DIR: each command runs there, so DIR can move to another host.
            command=backend.build_command(pb, neff),
            parameters=list(program.param_names), outputs=list(program.outputs)))
    return dumped


def write_script(directory: pathlib.Path, model_path: str, programs: list[DumpedProgram]) -> pathlib.Path:
    lines = [
        "#!/usr/bin/env bash",
        f"# neuronx-cc commands for the programs of {model_path}: each compiles NAME.pb into NAME.neff.",
        "# Run on a host with neuronx-cc (AWS Neuron SDK): bash compile.sh",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        *(shlex.join(p.command) for p in programs),
    ]
    script = directory / SCRIPT
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def write_manifest(directory: pathlib.Path, model: Any, model_path: str, backend: NeuronCCBackend,
                   tp_degree: int, programs: list[DumpedProgram]) -> pathlib.Path:
    manifest = {
        "model": model_path,
        "target": backend.target,
        "tp_degree": tp_degree,
        "batch_size": model.batch_size,
        "n_positions": model.n_positions,
        "amp": model.amp,
        "token_buckets": list(model.token_buckets),
        "context_buckets": list(model.context_buckets),
        "neuron_cc_flags": list(backend.flags),
        "script": SCRIPT,
        "command_cwd": ".",
        "programs": [dataclasses.asdict(p) for p in programs],
    }
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def _compile_one(directory: pathlib.Path, program: DumpedProgram) -> str | None:
    """Run one dumped command in DIR; None when it wrote NAME.neff, else what went wrong."""
    neff = directory / program.neff
    neff.unlink(missing_ok=True)  # a NEFF left by an earlier run must not pass for this one
    done = subprocess.run(program.command, cwd=directory, capture_output=True, text=True)
    log = directory / f"{pathlib.Path(program.pb).stem}.compile.log"
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stdout[-2000:] + done.stderr[-2000:]).strip()
        return (f"{program.name}: neuronx-cc failed (exit {done.returncode}): {shlex.join(program.command)}"
                f"\n{tail}")
    if not neff.exists():
        return (f"{program.name}: neuronx-cc exited 0 but wrote no {program.neff}: "
                f"{shlex.join(program.command)}")
    return None


def compile_programs(directory: pathlib.Path, programs: list[DumpedProgram], jobs: int) -> list[str]:
    """Run the dumped commands, `jobs` at a time, with a progress bar; the failures, if any."""
    from tqdm.auto import tqdm

    failures = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, tqdm(
        total=len(programs), desc=COMPILER, unit="program", disable=None
    ) as bar:
        futures = [pool.submit(_compile_one, directory, p) for p in programs]
        for future in as_completed(futures):
            error = future.result()
            if error is not None:
                failures.append(error)
            bar.update(1)
    return failures


def _missing_compiler_message(args: argparse.Namespace) -> str:
    target = f" --target {args.target}" if args.target else ""
    return (
        f"--compile needs {COMPILER}, which is not on PATH. Write the programs and their commands "
        f"now, without --compile (pyhlo compile {args.model}{target} --dump {args.dump}), then run "
        f"`bash {args.dump}/{SCRIPT}` on a Neuron host where {COMPILER} is installed. ({INSTALL_HINT})"
    )


def run(args: argparse.Namespace) -> int:
    if args.tp_degree < 1:
        raise ValueError(f"--tp-degree must be >= 1, got {args.tp_degree}")
    if args.compile and compiler_path() is None:
        print(f"pyhlo compile: error: {_missing_compiler_message(args)}", file=sys.stderr)
        return 2
    backend = NeuronCCBackend(target=args.target, cores=args.tp_degree)
    model = open_model(args, backend)
    directory = pathlib.Path(args.dump)
    model_path = str(model.checkpoint_path)
    programs = dump_programs(model, directory, backend, num_replicas=args.tp_degree)
    write_script(directory, model_path, programs)
    write_manifest(directory, model, model_path, backend, args.tp_degree, programs)

    rows = [(p.name, p.pb, hlo_report.human_bytes((directory / p.pb).stat().st_size), p.sha256[:12])
            for p in programs]
    print(hlo_report.format_table(["program", "file", "size", "sha256"], rows, right=(2,)))
    flags = f", flags {shlex.join(backend.flags)}" if backend.flags else ""
    print(f"\nwrote {len(programs)} programs, {SCRIPT} and {MANIFEST} to {directory} "
          f"(target {backend.target}, num_replicas {args.tp_degree}{flags})")
    if not args.compile:
        print(f"compile them on a Neuron host with neuronx-cc: bash {directory / SCRIPT}")
        return 0
    failures = compile_programs(directory, programs, args.jobs)
    for failure in failures:
        print(f"pyhlo compile: {failure}", file=sys.stderr)
    if failures:
        print(f"pyhlo compile: {len(failures)} of {len(programs)} programs failed; "
              "their output is in NAME.compile.log", file=sys.stderr)
        return 1
    print(f"ran {COMPILER} on {len(programs)} programs: NAME.neff in {directory}")
    return 0
