"""A tiny word-level tokenizer over the tiny models' 320 ids ("t0" .. "t319"), built locally."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0")


# Added tokens of the byte-level tokenizer: the chat markers of a Hermes-style template, the
# tool-call markers Hermes and Qwen models emit (not special, as in Qwen's tokenizer: decoded
# text keeps them), and the end of sequence.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}


def make_byte_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, as SmolLM2's and Llama 3's are) over
    at most `vocab_size` ids: every byte, a few merges JSON text uses, then SPECIAL, so any
    text (JSON, tool calls) has a tokenization, as with a real model's tokenizer. Its ids are
    dense (0 .. len - 1); a model may have more ids than it (as real ones pad their vocabulary)."""
    from tokenizers import decoders

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = sorted(alphabet)
    vocab = {token: i for i, token in enumerate(byte_of)}
    pairs = [('{', '"'), ('"', ':'), ('"', ','), ('"', '}'), ('Ġ', '"'), ('Ġ', '{'), (':', 'Ġ'), (',', 'Ġ'),
             ('n', 'a'), ('m', 'e'), ('a', 'r'), ('e', 'r'), ('i', 'n'), ('o', 'n'), ('t', 'r'), ('u', 'e')]
    merges = []
    for a, b in pairs:
        if len(vocab) >= vocab_size - len(SPECIAL):
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for token in SPECIAL:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([t for t in SPECIAL if t not in NOT_SPECIAL])
    tokenizer.add_tokens([t for t in SPECIAL if t in NOT_SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
