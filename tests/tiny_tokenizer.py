"""A tiny word-level tokenizer over the tiny models' 320 ids ("t0" .. "t319"), built locally."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0")
