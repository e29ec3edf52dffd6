"""Which grammar engine constrains the server's JSON output: llguidance, xgrammar and
outlines-core measured on one strict JSON schema, per tokenizer.

    python -m tools.bench.grammar_engines              # the tiny byte-level tokenizer and SmolLM2's

For each engine: the time to compile the schema for the tokenizer (the tokenizer's own set-up
apart, done once per server), and the time of one token's mask (computing the allowed tokens,
then consuming the token) along a valid answer's tokens, mean and worst. The server takes
llguidance (serving/structured.py): the fastest compile by far, a mask within microseconds of
xgrammar's, so the least time per request (compile + mask) for answers under ~900 tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}

ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"],
          "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
          "active": True}


def _llguidance(tokenizer: Any, vocab: int) -> tuple[Callable, Callable]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_() -> Any:
        return llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))

    mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def step(matcher: Any, token: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        assert (mask[0, token // 32] >> (token % 32)) & 1, "the engine refused a valid token"
        assert matcher.consume_token(token), matcher.get_error()

    return compile_, step


def _xgrammar(tokenizer: Any, vocab: int) -> tuple[Callable, Callable]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_() -> Any:
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True,
                                                                    any_whitespace=False))

    mask = xgrammar.allocate_token_bitmask(1, vocab)

    def step(matcher: Any, token: int) -> None:
        matcher.fill_next_token_bitmask(mask)
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, "the engine refused a valid token"
        assert matcher.accept_token(token)

    return compile_, step


def _outlines_core(tokenizer: Any, vocab: int) -> tuple[Callable, Callable]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    # outlines-core takes the vocabulary as each token's bytes (byte-level BPE's alphabet undone).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    tokens: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i in special or i >= vocab:
            continue
        try:
            raw = bytes(byte_of[c] for c in text)
        except KeyError:
            raw = text.encode()
        tokens.setdefault(raw, []).append(i)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile_() -> Any:
        regex = build_regex_from_schema(json.dumps(SCHEMA))
        return outlines_core.Guide(outlines_core.Index(regex, vocabulary))

    mask = np.zeros((vocab + 31) // 32, np.int32)

    def step(guide: Any, token: int) -> None:
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        assert (int(mask[token // 32]) >> (token % 32)) & 1, "the engine refused a valid token"
        guide.advance(token)

    return compile_, step


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core}


def measure(tokenizer: Any, vocab: int, engines: list[str] | None = None,
            repeats: int = 3) -> dict[str, dict]:
    """Per engine: its tokenizer set-up, compile and per-token mask times (ms) for SCHEMA on `tokenizer`."""
    answer = list(tokenizer(json.dumps(ANSWER), add_special_tokens=False)["input_ids"])
    figures = {}
    for name in engines or list(ENGINES):
        started = time.perf_counter()
        compile_, step = ENGINES[name](tokenizer, vocab)
        setup = time.perf_counter() - started
        compiles, masks = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            matcher = compile_()
            compiles.append(time.perf_counter() - started)
            for token in answer:
                started = time.perf_counter()
                step(matcher, token)
                masks.append(time.perf_counter() - started)
        figures[name] = {"tokenizer_setup_ms": setup * 1e3, "compile_ms": statistics.median(compiles) * 1e3,
                         "mask_mean_ms": statistics.mean(masks) * 1e3, "mask_max_ms": max(masks) * 1e3,
                         "tokens": len(answer)}
    return figures


def _tokenizers(which: list[str]) -> dict[str, tuple[Any, int]]:
    found = {}
    if "tiny" in which:
        import pathlib
        import sys

        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
        from tiny_tokenizer import make_byte_tokenizer

        found["tiny byte-level (320 ids)"] = (make_byte_tokenizer(), 320)
    if "smollm2" in which:
        from decoders.checkpoints.default_model import default_model_path
        from decoders.checkpoints.open import open_checkpoint

        tokenizer = open_checkpoint(default_model_path()).tokenizer()
        found[f"SmolLM2 ({len(tokenizer)} ids)"] = (tokenizer, len(tokenizer))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizers", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = parser.parse_args()
    for label, (tokenizer, vocab) in _tokenizers(args.tokenizers).items():
        print(label)
        for name, f in measure(tokenizer, vocab, args.engines).items():
            print(f"  {name:14s} tokenizer set-up {f['tokenizer_setup_ms']:8.1f} ms  compile "
                  f"{f['compile_ms']:8.2f} ms  mask mean {f['mask_mean_ms']:.4f} ms  max "
                  f"{f['mask_max_ms']:.3f} ms  ({f['tokens']} tokens)")


if __name__ == "__main__":
    main()
