"""The CPU benchmark (`pyhlo bench`): pyhlo, HF transformers and llama.cpp on the same weights,
at each precision and batch size, against the memory-bandwidth roofline measured in the same run.

llama.cpp reads a GGUF file written from our dequantized weights (peers.peer_gguf) or, for the
gguf precisions, the model's own file. The bandwidth is probed before the first configuration
and after each; the best probe counts, as other processes only ever lower it.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import numpy as np

from tools.bench import peers, report
from tools.bench.machine import OtherLoad, machine_info, measure_bandwidth, measure_matmul_rate
from tools.bench.pyhlo_runner import pyhlo_options
from tools.bench.rounds import measure_config, new_row
from tools.bench.settings import default_or_given_model, resolve_engines, resolve_settings

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


def weight_bytes(model_path: pathlib.Path, amp: str, n_positions: int) -> int:
    """Bytes of weights one decode step reads, from the parameters pyhlo declares at `amp`
    (each in the element type it is stored in: int8 and f32 scales for s8, a GGUF's blocks as
    stored for gguf): every layer's
    once per layer, the shared ones once. Embedding tables are left out (a step reads one row
    of each); a tied LM head is a linear weight and stays in."""
    from decoders import NeuronAutoModelForCausalLM
    from decoders.blocks.params import Kind
    from pyhlo.dtypes import byte_size

    model = NeuronAutoModelForCausalLM.from_pretrained(model_path, n_positions=n_positions,
                                                       **pyhlo_options(amp))
    builder = model.session.builder
    declared = [(p, builder.decoder.n_layers) for p in builder.layer_params()]
    declared += [(p, 1) for p in builder.shared_params()]
    return sum(math.prod(spec.dims) * byte_size(spec.dtype) * n
               for p, n in declared if p.kind is not Kind.TABLE or p.part_of for spec in [builder.spec(p)])


def layer_flops_per_token(model_path: pathlib.Path) -> float:
    """2 x the decoder layers' weight elements: the multiply-adds of one prompt token's pass
    through the layers (attention's own products and the LM head, run for the last token only,
    left out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from decoders.checkpoints import open_checkpoint

    with open_checkpoint(model_path) as checkpoint:
        config = dict(checkpoint.config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    layers = model.get_decoder().layers
    return 2.0 * sum(p.numel() for p in layers.parameters() if p.dim() >= 2)


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


def run(args: argparse.Namespace) -> int:
    """Measure every precision and batch size; print the report and write its files."""
    settings = resolve_settings(args)
    engines, unavailable = resolve_engines(args.engines)
    model_path = default_or_given_model(args)
    if args.model and not model_path.exists():
        raise FileNotFoundError(f"--model {args.model}: no such file or directory")
    out = pathlib.Path(args.out)
    logs = out / "logs"
    notes = [f"{e} left out: {why}" for e, why in unavailable.items() if e not in engines]
    if "llamacpp" in engines and "llamacpp" not in unavailable and model_path.suffix != ".gguf":
        unavailable["llamacpp"] = "llama.cpp reads .gguf models only"
    as_stored = [amp for amp in settings["amps"] if amp in ("gguf", "gguf-x8")]
    if as_stored and model_path.suffix != ".gguf":
        # Said before anything is measured: asked for, an error; by default, left out.
        if args.amp:
            raise ValueError(f"--amp {','.join(as_stored)} runs a GGUF model's weights as stored; "
                             f"{model_path} is not a .gguf")
        settings["amps"] = [amp for amp in settings["amps"] if amp not in as_stored]
        notes.append(f"{', '.join(as_stored)} left out: {model_path.name} is not a GGUF file")

    load = OtherLoad(settings["quiet_wait"])

    def probe_bandwidth() -> None:
        load.wait()
        probes.append(measure_bandwidth(settings["bandwidth_mb"], settings["threads"]))

    print("measuring memory bandwidth ...", file=sys.stderr)
    probes: list[dict] = []
    probe_bandwidth()
    print("measuring the f32 matrix-product rate ...", file=sys.stderr)
    load.wait()
    prefill = {"flops_per_token": layer_flops_per_token(model_path),
               "matmul": measure_matmul_rate(settings["threads"])}
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
                raise ValueError(f"--amp gguf runs a GGUF model's weights as stored; {model_path} is not a "
                                 ".gguf")
            model_files["llamacpp"] = model_path
        elif "llamacpp" in engines and "llamacpp" not in unavailable:
            print(f"{peers.GGUF_KINDS[amp][0]} GGUF for llama.cpp ...", file=sys.stderr)
            model_files["llamacpp"] = peers.peer_gguf(model_path, amp)
        for batch in settings["batches"]:
            runnable = [e for e in engines if e not in missing]
            load.start()
            rows, bucket_list = measure_config(model_path, runnable, amp, batch, settings,
                                               prompts_all[:batch], model_files, logs, load)
            busy.append({"amp": amp, "batch": batch, **load.stop()})
            for engine in engines:
                if engine in missing:
                    rows.append({**new_row(engine, amp, batch), "status": "unavailable",
                                 "error": missing[engine]})
            results += rows
            buckets += bucket_list
            probe_bandwidth()
    # Other processes only ever lower a probe: the best one is the machine's bandwidth.
    bandwidth = dict(max(probes, key=lambda b: b["gb_per_s"]),
                     all_probes_gb_per_s=[b["gb_per_s"] for b in probes])
    sizes = {amp: weight_bytes(model_path, amp, settings["n_positions"]) for amp in settings["amps"]}
    workload = {"model": model_path.name, "prompt_tokens": settings["prompt_tokens"],
                "new_tokens": settings["new_tokens"], "repeats": settings["repeats"],
                "n_positions": settings["n_positions"], "threads": settings["threads"],
                "engines": engines, "amps": settings["amps"], "batches": settings["batches"],
                "quick": bool(args.quick)}
    full_report = report.assemble(report.SCHEMA, machine_info(), workload, bandwidth, sizes, results, busy,
                                  settings, notes, buckets, prefill)
    paths = report.write_all(full_report, out)
    print(report.markdown(full_report))
    print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}", file=sys.stderr)
    return 0
