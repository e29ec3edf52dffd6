"""Show what was built: HLO text, instructions by opcode, parameters, cost, graphs.

TARGET is one of:
  MODULE.pb               a serialized HloModuleProto
  path/to/file.py:func    a function of the scribe, built with compile_py_func(func), e.g.
                            def double(scribe):
                                x = scribe.f32[16].Parameter(parameter_number=0)
                                return scribe.f32[16].Add(x, x)
  MODEL                   an HF checkpoint directory or a .gguf file, or `default` for
                          SmolLM2-135M-Instruct; every program model.eager_programs() lists
                          is built (per bucket, with --batch-size, --n-positions, --amp,
                          --context-length-estimate)

For a module, the sections are:
  text      the HLO text, in XLA's own format
  opcodes   a table of instructions by opcode, most frequent first
  params    parameters (number, name, shape, bytes), outputs, and input_output_alias
            (outputs that reuse a parameter's memory, e.g. KV caches updated in place)
  cost      XLA's cost analysis of the unoptimized module: flops, transcendentals,
            bytes accessed (an estimate; nothing is compiled; XLA:CPU's where the
            platform's client has none, as jax's CUDA plugin), plus the work inside
            pyhlo's kernels (custom calls XLA cannot see into), counted from their shapes
By default every section is shown, except the HLO text of a module with more than
300 instructions (add --section text to print it, or --dump DIR to write it).

For a model, a table of every program of every bucket (instructions, parameters,
flops and bytes accessed as XLA + kernels, parameter and output bytes) and the
model's device memory: weights (n_layers x one layer + shared) and KV cache
(2 x n_layers x batch x kv_heads x n_positions x head_dim x dtype bytes).
--program NAME shows one of those programs like a module.

--dump DIR writes NAME.pb, NAME.txt (HLO text) and NAME.dot (Graphviz) for the module
or for every program of the model (only NAME with --program); --svg / --png also render
NAME.svg / NAME.png with Graphviz's `dot` command when it is installed.

examples:
  pyhlo inspect program.pb
  pyhlo inspect program.pb --section text
  pyhlo inspect my_ops.py:double --section opcodes,cost
  pyhlo inspect default
  pyhlo inspect path/to/llama-dir --n-positions 256 --batch-size 2 --amp bf16
  pyhlo inspect default --program model_n1_s1024 --section params
  pyhlo inspect default --per-block --program block_n1_s1024 --dump out --svg
"""
from __future__ import annotations

import argparse
import sys

from tools import hlo_report
from tools.model_options import add_model_arguments


def _sections(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    for name in names:
        if name not in hlo_report.SECTIONS + ("all",):
            raise argparse.ArgumentTypeError(
                f"unknown section {name!r}; choose from {', '.join(hlo_report.SECTIONS)}, all")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="TARGET",
                        help="MODULE.pb | path/to/file.py:function | model directory or .gguf | default")
    parser.add_argument("--section", type=_sections, action="append", metavar="NAME[,NAME]",
                        help=f"sections to show for a module: {', '.join(hlo_report.SECTIONS)}, all "
                             "(repeatable; default: all but the text of modules over "
                             f"{hlo_report.TEXT_LIMIT} instructions)")
    parser.add_argument("--program", metavar="NAME",
                        help="for a model: show this program (e.g. model_n1_s128, or block_n1_s128 "
                             "with --per-block) like a module")
    parser.add_argument("--dump", metavar="DIR", help="write NAME.pb, NAME.txt and NAME.dot of each module")
    parser.add_argument("--svg", action="store_true", help="with --dump: also render NAME.svg (Graphviz)")
    parser.add_argument("--png", action="store_true", help="with --dump: also render NAME.png (Graphviz)")
    model = parser.add_argument_group("model targets")
    add_model_arguments(model)
    model.add_argument("--per-block", action="store_true",
                       help="one program per decoder block, reused by every layer (block_n*, embed_n*, "
                            "lm_head_n*), instead of the whole model per bucket (model_n*), the default "
                            "on XLA:CPU")


def _open_model(target: hlo_report.Target, args: argparse.Namespace):
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path
    from tools.model_options import weight_options

    path = target.path if target.path is not None else default_model_path()
    config = NeuronConfig(whole_model_program=False if args.per_block else None, **weight_options(args))
    return NeuronAutoModelForCausalLM.from_pretrained(
        path, batch_size=args.batch_size, n_positions=args.n_positions, amp=args.amp,
        context_length_estimate=args.context_length_estimate, neuron_config=config)


def _dump(reports: list[hlo_report.ModuleReport], directory: str, formats: list[str]) -> int:
    dot = hlo_report.graphviz_dot() if formats else None
    if formats and dot is None:
        print(hlo_report.DOT_MISSING, file=sys.stderr)
    status = 0
    for report in reports:
        written = hlo_report.dump_module(directory, report)
        dot_file = written[-1]
        for fmt in formats if dot else ():
            try:
                written.append(hlo_report.render_dot(dot_file, fmt, dot))
            except RuntimeError as error:  # the .pb, .txt and .dot files are written all the same
                print(f"pyhlo inspect: {error}", file=sys.stderr)
                status = 1
        suffixes = ",".join(p.suffix.lstrip(".") for p in written)
        print(f"wrote {written[0].with_suffix('')}.{{{suffixes}}}")
    return status


def run(args: argparse.Namespace) -> int:
    sections = None
    if args.section:
        sections = [s for group in args.section for s in group]
        sections = list(hlo_report.SECTIONS) if "all" in sections else list(dict.fromkeys(sections))
    formats = [f for f in hlo_report.RENDER_FORMATS if getattr(args, f)]
    if formats and not args.dump:
        raise ValueError("--svg and --png render the graphs that --dump DIR writes: add --dump DIR")

    target = hlo_report.parse_target(args.target)
    if target.kind == "model":
        model = _open_model(target, args)
        reports = hlo_report.program_reports(model)
        if args.program:
            by_name = {r.name: r for r in reports}
            if args.program not in by_name:
                raise ValueError(f"no program {args.program!r}; this model's programs: {', '.join(by_name)}")
            reports = [by_name[args.program]]
            print(hlo_report.format_module(reports[0], sections))
        else:
            if sections:
                raise ValueError("--section applies to one module: add --program NAME")
            print(hlo_report.format_model(model, reports))
    else:
        if args.program:
            raise ValueError("--program picks a program of a model; the target is a single module")
        if target.kind == "python":
            module_bytes = hlo_report.module_from_python(target.path, target.function).SerializeToString()
        else:
            module_bytes = hlo_report.read_module(target.path)
        reports = [hlo_report.module_report(module_bytes)]
        print(hlo_report.format_module(reports[0], sections))

    if args.dump:
        print()
        return _dump(reports, args.dump, formats)
    return 0
