"""The server's streamed text: each token's text goes out as soon as it is decoded (a character
whose bytes are not all there waits for them), where the tokenizer's decoding only appends; with
a tokenizer that cleans up spaces, HF's TextStreamer's word-by-word rule. Either way the pieces
add up to the decoded reply."""
from __future__ import annotations

import pytest
import torch
from tiny_tokenizer import make_byte_tokenizer
from transformers import TextStreamer

from serving.engine import _QueueStreamer

TEXT = "Hi 😀 there, friend.\nNext line: 日本 ok"


class Collected(_QueueStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, loop=None, queue=None)
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)


def stream(streamer, ids: list[int]) -> list[str]:
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    return streamer.pieces


def test_each_tokens_text_goes_out_at_once_and_an_unfinished_character_waits():
    tokenizer = make_byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = False
    ids = tokenizer(TEXT)["input_ids"]
    streamer = Collected(tokenizer)
    assert streamer.at_once
    pieces = stream(streamer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert pieces[0] == tokenizer.decode(ids[:1]) != ""             # the first token, with no wait
    assert not any("\ufffd" in piece for piece in pieces)         # the emoji's 4 bytes went out together
    # Every piece is out by the token that completes it: after token i, the decoded text of
    # tokens 0..i less an unfinished character.
    for i in range(len(ids)):
        sent = "".join(pieces[:i + 1])
        assert sent == tokenizer.decode(ids[:i + 1]).rstrip("\ufffd")


def test_a_tokenizer_that_cleans_up_spaces_streams_word_by_word_as_text_streamer_does():
    tokenizer = make_byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer(TEXT)["input_ids"]
    streamer = Collected(tokenizer)
    assert not streamer.at_once

    class Reference(TextStreamer):
        pieces: list[str] = []

        def on_finalized_text(self, text, stream_end=False):
            self.pieces.append(text)

    reference = stream(Reference(tokenizer, skip_special_tokens=True), ids)
    assert stream(streamer, ids) == reference
    assert reference[0] == ""                                      # the first word waits for a space


@pytest.mark.parametrize("text", ["a\n\nb", "\n", "x" * 5])
def test_lines_and_repeats_add_up(text):
    tokenizer = make_byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = False
    ids = tokenizer(text)["input_ids"]
    assert "".join(stream(Collected(tokenizer), ids)) == text
