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
VERBOSE_HELP = "log what is compiled and loaded"
# Phase lines of slow first-run steps (kernel build and timing, model and tokenizer conversion):
# shown without -v, so that a long first command is not silent.
PROGRESS_LOGGER = "pyhlo.progress"


def package_version() -> str:
    """pyhlo's version as installed (package metadata)."""
    from importlib import metadata

    try:
        return metadata.version("pyhlo")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyhlo",
        description="pyhlo: decoder LLMs written as XLA HLO programs, compiled per bucket and run "
                    "on the device by a thin runtime.",
        epilog="Run `pyhlo COMMAND --help` for each command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--version", action="version", version=f"pyhlo {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        # -v after the command too (`pyhlo generate -v ...`); SUPPRESS keeps a -v given before it.
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
        sub.set_defaults(run=module.run)
    return parser


class _Formatter(logging.Formatter):
    """'pyhlo: message' for pyhlo's records (its phase lines too), 'name: message' for others."""

    def format(self, record: logging.LogRecord) -> str:
        name = "pyhlo" if record.name.startswith("pyhlo") else record.name
        return f"{name}: {record.getMessage()}"


def configure_logging(verbose: bool) -> None:
    """pyhlo's own records at INFO with -v (other libraries' INFO, such as jax's note that it
    found no TPU, stay hidden), its phase lines always, warnings from everyone."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_Formatter())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    logging.getLogger("pyhlo").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    configure_logging(args.verbose)
    try:
        if extras:
            # A command may read arguments argparse left over (generate: MODEL before options).
            take = getattr(args, "extra_positionals", None)
            if take is None:
                parser.error(f"unrecognized arguments: {' '.join(extras)}")
            take(args, extras)
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"pyhlo {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
