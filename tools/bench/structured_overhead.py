"""What a JSON schema costs a decode step: the batcher's time per step with every line held to a
schema (llguidance's mask on the host, serving/structured.py) against the same lines free.

    python -m tools.bench.structured_overhead [--model PATH] [--batch 1 8] [--tokens 64]

Both runs take the same number of steps: end-of-sequence tokens do not end a line, and the schema
(an array of at least 100 strings) never closes within the token budget. Rounds alternate free and
constrained runs, so a machine's drift touches both; the medians are compared.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["notes"],
          "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 100}}}


def run_once(model: Any, prompts: list[list[int]], tokens: int, grammars: Any | None,
             sample: bool) -> tuple[float, float]:
    """(seconds per decode step, of which seconds in the grammar's work) for `prompts` as one
    batch, each line held to SCHEMA when grammars is given."""
    from serving.scheduler import ContinuousBatcher
    from serving.structured import json_schema_grammar

    batcher = ContinuousBatcher(model)
    grammar = json_schema_grammar(SCHEMA) if grammars is not None else None
    spent = [0.0]

    def timed(work):
        def run(*args):
            started = time.perf_counter()
            try:
                return work(*args)
            finally:
                spent[0] += time.perf_counter() - started
        return run

    requests = []
    for i, prompt in enumerate(prompts):
        constraint = None
        if grammar is not None:
            constraint = grammars.constraint(grammar)
            # masked() is the sampling path; greedy() calls it itself where the argmax is refused.
            for name in ("greedy", "accept") if not sample else ("masked", "accept"):
                setattr(constraint, name, timed(getattr(constraint, name)))
        requests.append(batcher.submit(prompt, tokens, constraint=constraint, do_sample=sample, seed=i))
    while any(r.written < len(r.prompt) for r in requests):      # prompts in: decode steps alone are timed
        batcher.step()
    steps, spent[0], started = batcher.steps, 0.0, time.perf_counter()
    while batcher.busy:
        batcher.step()
    assert all(r.finish_reason == "length" for r in requests), [r.finish_reason for r in requests]
    taken = batcher.steps - steps
    return (time.perf_counter() - started) / taken, spent[0] / taken


def measure(model_path: str, batches: list[int], tokens: int, rounds: int) -> dict[tuple[int, str], dict]:
    """Per (batch, "greedy" | "sampling"): decode step ms free and with SCHEMA, the grammar's own
    ms per step, and the overhead as shares of the free step (A/B, and the grammar's own time)."""
    from decoders import ContinuousBatchingConfig, LlamaForSampling, NeuronConfig
    from serving.structured import Grammars

    lines = max(batches)
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=lines))
    model = LlamaForSampling.from_pretrained(model_path, batch_size=lines, n_positions=256,
                                             context_length_estimate=[32], neuron_config=config).to_neuron()
    tokenizer = model.tokenizer
    grammars = Grammars(tokenizer, model.decoder.head.vocab_size, ())
    assert grammars.tokenizer is not None                         # built once per server, not timed
    prompts = [list(tokenizer(f"Write notes about topic {i}:")["input_ids"]) for i in range(lines)]
    figures = {}
    for batch in batches:
        for sample in (False, True):
            run_once(model, prompts[:batch], 4, grammars, sample)            # warm-up
            free, held, own = [], [], []
            for _ in range(rounds):
                free.append(run_once(model, prompts[:batch], tokens, None, sample)[0])
                step, grammar_time = run_once(model, prompts[:batch], tokens, grammars, sample)
                held.append(step)
                own.append(grammar_time)
            f, h, g = statistics.median(free), statistics.median(held), statistics.median(own)
            figures[(batch, "sampling" if sample else "greedy")] = {
                "free_ms": f * 1e3, "json_schema_ms": h * 1e3, "grammar_ms": g * 1e3,
                "overhead_ab": (h - f) / f, "overhead_grammar": g / f}
    return figures


def report(figures: dict[tuple[int, str], dict]) -> str:
    """One line per batch size and choice."""
    return "\n".join(
        f"batch {batch} {mode:8s}: decode step {f['free_ms']:7.2f} ms free, {f['json_schema_ms']:7.2f} ms "
        f"with a JSON schema ({f['overhead_ab']:+.1%}); the grammar's own work {f['grammar_ms']:.3f} ms a "
        f"step ({f['overhead_grammar']:.1%} of the free step)" for (batch, mode), f in figures.items())


def run(args: argparse.Namespace) -> int:
    """`pyhlo bench --structured`: --model (default: the default model), --batch (default 1,8),
    --new-tokens (default 64), --repeats (rounds, default 5)."""
    from tools.bench.settings import csv, default_or_given_model

    batches = [int(b) for b in csv(args.batch)] if args.batch else [1, 8]
    figures = measure(str(default_or_given_model(args)), batches, args.new_tokens or 64, args.repeats or 5)
    print(report(figures))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint (default: SmolLM2-135M-Instruct, the default model)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    path = args.model
    if path is None:
        from decoders.checkpoints.default_model import default_model_path

        path = str(default_model_path())
    print(report(measure(path, args.batch, args.tokens, args.rounds)))


if __name__ == "__main__":
    main()
