"""`pyhlo`: command-line programs over the library (generate, inspect, bench, compile)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "generate": ("tools.generate", "generate text with a model (default: SmolLM2-135M-Instruct)"),
    "inspect": ("tools.inspect_hlo", "show what was built: HLO text, op counts, shapes, cost, graphs"),
    "bench": ("tools.bench.command", "measure speed and memory against HF transformers (and llama.cpp)"),
    "serve": ("tools.serve", "serve a model over an OpenAI-compatible HTTP API (continuous batching)"),
    "compile": ("tools.compile_neuron", "write a model's programs (.pb) and the neuronx-cc commands that "
                                        "compile them for trn1, inf2 or trn2"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyhlo",
        description="pyhlo: decoder LLMs written as XLA HLO programs, compiled per bucket and run "
                    "on the device by a thin runtime.",
        epilog="Run `pyhlo COMMAND --help` for each command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is compiled and loaded")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"pyhlo {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
