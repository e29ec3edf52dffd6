"""`pyhlo bench --speculative K`: speculative decoding's speed-up over the target alone.

The target is the model widened to f32 at load (SmolLM2's GGUF: its Q4_1 weights dequantized);
the draft is the same file with its blocks kept as stored (NeuronConfig(gguf_blocks=True)),
which reads about a sixth of the bytes per step. Both run greedy over the same chat prompts:
the target's sample() alone, then SpeculativeGenerator(draft, target, K).sample(). Reported:
tokens per second of each (median over the prompts of the generation's wall time, prefill
included), the speed-up, the acceptance rate, target calls per generated token, and whether
each speculative output equals the target's token for token (it must: greedy).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tools.bench.machine import machine_info
from tools.bench.settings import default_or_given_model

QUESTIONS = ["Write a short story about a lighthouse keeper.",
             "Explain how a bicycle works to a child.",
             "Give three tips for learning a new language, with a sentence on each."]


def _prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def measure(model_path: Path, k: int, new_tokens: int, n_positions: int = 512) -> dict:
    import torch

    from decoders import NeuronAutoModelForCausalLM, NeuronConfig, SpeculativeGenerator
    from decoders.checkpoints import open_checkpoint

    tokenizer = open_checkpoint(model_path).tokenizer()
    print(f"[speculative] target: {model_path.name} widened to f32, k={k}", file=sys.stderr, flush=True)
    target = NeuronAutoModelForCausalLM.from_pretrained(model_path, batch_size=1, n_positions=n_positions,
                                                        amp="f32",
                                                        neuron_config=NeuronConfig(gguf_blocks=False))
    target.enable_speculative_decoder(k)
    target.to_neuron()
    print("[speculative] draft: the same file's blocks as stored", file=sys.stderr, flush=True)
    draft = NeuronAutoModelForCausalLM.from_pretrained(model_path, batch_size=1, n_positions=n_positions,
                                                       amp="f32",
                                                       neuron_config=NeuronConfig(gguf_blocks=True))
    draft.to_neuron()
    generator = SpeculativeGenerator(draft, target, k)
    prompts = [_prompt_ids(tokenizer, q) for q in QUESTIONS]
    # Warm-up: first calls of each program.
    target.sample(torch.tensor([prompts[0]]), sequence_length=len(prompts[0]) + 8, top_k=1)
    generator.sample(torch.tensor([prompts[0]]), sequence_length=len(prompts[0]) + 8, top_k=1)
    generator.proposed = generator.accepted = generator.target_calls = 0

    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        length = len(prompt) + new_tokens
        started = time.perf_counter()
        alone = target.sample(ids, sequence_length=length, top_k=1, eos_token_id=[])
        alone_s = time.perf_counter() - started
        calls_before, proposed_before, accepted_before = (generator.target_calls, generator.proposed,
                                                          generator.accepted)
        started = time.perf_counter()
        fast = generator.sample(ids, sequence_length=length, top_k=1, eos_token_id=[])
        fast_s = time.perf_counter() - started
        generated = alone.shape[1] - len(prompt)
        rows.append({"prompt_tokens": len(prompt), "new_tokens": generated,
                     "target_tokens_per_s": generated / alone_s,
                     "speculative_tokens_per_s": generated / fast_s,
                     "same_tokens": bool(torch.equal(alone, fast)),
                     "target_calls": generator.target_calls - calls_before,
                     "acceptance_rate": (generator.accepted - accepted_before)
                     / max(1, generator.proposed - proposed_before)})
    alone = statistics.median(r["target_tokens_per_s"] for r in rows)
    fast = statistics.median(r["speculative_tokens_per_s"] for r in rows)
    return {"k": k, "new_tokens": new_tokens, "prompts": rows, "target_tokens_per_s": alone,
            "speculative_tokens_per_s": fast, "speed_up": fast / alone,
            "acceptance_rate": generator.acceptance_rate,
            "tokens_per_target_call": sum(r["new_tokens"] for r in rows) / max(1, generator.target_calls),
            "all_same_tokens": all(r["same_tokens"] for r in rows)}


def table(result: dict) -> str:
    lines = ["| prompt tokens | new tokens | target alone tok/s | speculative tok/s | speed-up | acceptance "
             "| same tokens |", "|---|---|---|---|---|---|---|"]
    for r in result["prompts"]:
        lines.append(f"| {r['prompt_tokens']} | {r['new_tokens']} | {r['target_tokens_per_s']:.1f} | "
                     f"{r['speculative_tokens_per_s']:.1f} | "
                     f"{r['speculative_tokens_per_s'] / r['target_tokens_per_s']:.2f}x | "
                     f"{r['acceptance_rate']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    lines.append(f"| median | | {result['target_tokens_per_s']:.1f} | "
                 f"{result['speculative_tokens_per_s']:.1f} | {result['speed_up']:.2f}x | "
                 f"{result['acceptance_rate']:.2f} | {'yes' if result['all_same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`pyhlo bench --speculative K`: measure, print the table, write speculative.md and .json."""
    model_path = default_or_given_model(args)
    if model_path.suffix != ".gguf":
        raise ValueError("--speculative drafts with the model's GGUF blocks as stored: give a .gguf --model")
    if args.speculative < 1:
        raise ValueError(f"--speculative K needs K >= 1, got {args.speculative}")
    result = measure(model_path, args.speculative, args.new_tokens or 128)
    info = machine_info()
    text = (f"Speculative decoding: target {model_path.name} widened to f32, draft the same file's blocks as "
            f"stored, k={result['k']}, greedy, {result['new_tokens']} new tokens; "
            f"{result['tokens_per_target_call']:.2f} tokens per target call; "
            f"CPU {info.get('cpu')}, {args.threads} threads\n\n" + table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.md").write_text(text + "\n")
    (out / "speculative.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0 if result["all_same_tokens"] else 1
