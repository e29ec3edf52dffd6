"""Prompt chunks of several lines prefilled in one program (Session.prefill_lines): each line's
logits and cache as its own one-line program (prefill_line) makes them, and the batcher's
prompts arriving together each getting HF transformers' greedy tokens for it alone."""
from __future__ import annotations

import numpy as np
import pytest
from test_continuous_batching import SHAPE, batched_model, hf_greedy

from decoders import ContinuousBatchingConfig, LlamaForSampling, NeuronConfig
from serving.scheduler import ContinuousBatcher

# Per line: (prefix already in its cache, chunk tokens written now into a chunk of 16). Some
# chunks reach past 16 slots (attending to a token bucket), some start their prompts
# (attending to their own width), some leave padding after their last token.
WIDTH = 16
CHUNKS = {0: ([], list(range(40, 51))),
          1: (list(range(5, 25)), list(range(60, 66))),
          2: ([], list(range(120, 136))),
          3: (list(range(100, 107)), list(range(200, 214)))}


def _with_prefixes(path, lines: int):
    """A model whose lines hold CHUNKS' prefixes, written line by line. Its weights are placed
    and its programs compiled on first use: these tests run a few of them, not every bucket's."""
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=lines))
    model = LlamaForSampling.from_pretrained(path, batch_size=lines, neuron_config=config, **SHAPE)
    model.session.load_weights(model.checkpoint)
    for line, (prefix, _) in CHUNKS.items():
        for done in range(0, len(prefix), WIDTH):
            part = prefix[done:done + WIDTH]
            tokens = np.zeros((1, WIDTH), np.int32)
            tokens[0, :len(part)] = part
            model.session.prefill_line(tokens, line, done, len(part) - 1)
    return model


def _chunks(lines: list[int]) -> tuple[np.ndarray, list[int], list[int]]:
    """token_ids, slots and last_index of CHUNKS' chunks for these lines."""
    tokens = np.zeros((len(lines), WIDTH), np.int32)
    for i, line in enumerate(lines):
        tokens[i, :len(CHUNKS[line][1])] = CHUNKS[line][1]
    return tokens, [len(CHUNKS[line][0]) for line in lines], [len(CHUNKS[line][1]) - 1 for line in lines]


def _caches(session) -> list[np.ndarray]:
    """Every layer's keys and values below n_positions (the scratch slots past it hold padding)."""
    host = session.placement.host
    return [host(c)[:, :, :session.n_positions] for c in (*session.kv_cache.keys, *session.kv_cache.values)]


@pytest.mark.parametrize("n_lines, lines", [
    (4, [3, 1]),           # the programs for two rows, exactly filled
    (4, [0, 2]),           # two first chunks: attending to their own width only
    (8, [3, 0, 1]),        # the four-row programs: the fourth row pads into a line not given
    (4, [2, 0, 3]),        # more rows than decode_rows() holds: the program over every line
    (4, [3]),              # one line: the one-line programs
])
def test_lines_prefilled_together_match_each_line_alone(tiny_llama, n_lines, lines):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    together, alone = _with_prefixes(path, n_lines), _with_prefixes(path, n_lines)
    tokens, slots, last = _chunks(lines)
    logits = together.session.prefill_lines(tokens, lines, slots, last)
    assert logits.shape == (len(lines), 320)
    for i, line in enumerate(lines):
        one = alone.session.host_logits(alone.session.prefill_line(tokens[i:i + 1], line, slots[i], last[i]))
        np.testing.assert_allclose(logits[i], one[0], rtol=1e-5, atol=1e-5)
    # Every line's cache as the one-line programs left it: the lines given written alike, the
    # others (and the lines a padding row went to) untouched below n_positions.
    for got, want in zip(_caches(together.session), _caches(alone.session)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_every_position_logits_of_lines_prefilled_together(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    together, alone = _with_prefixes(path, 4), _with_prefixes(path, 4)
    lines = [3, 1]
    tokens, slots, last = _chunks(lines)
    every = together.session.prefill_lines(tokens, lines, slots, last, every_position=True)
    assert every.shape == (2, WIDTH, 320)
    for i, line in enumerate(lines):
        one = alone.session.host_logits(alone.session.prefill_line(tokens[i:i + 1], line, slots[i], last[i],
                                                                   every_position=True))
        np.testing.assert_allclose(every[i, :last[i] + 1], one[0, :last[i] + 1], rtol=1e-5, atol=1e-5)


def test_bad_prefill_lines_arguments_are_clear_errors(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    session = batched_model(path).session
    chunk = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="n a context bucket"):
        session.prefill_lines(np.zeros((2, 5), np.int32), [0, 1], [0, 0], [4, 4])
    with pytest.raises(ValueError, match="k in 1..4"):
        session.prefill_lines(np.zeros((5, 8), np.int32), [0, 1, 2, 3, 0], [0] * 5, [0] * 5)
    with pytest.raises(ValueError, match="one per row"):
        session.prefill_lines(chunk, [0, 1, 2], [0, 0], [4, 4])
    with pytest.raises(ValueError, match="distinct lines in 0..3"):
        session.prefill_lines(chunk, [1, 1], [0, 0], [4, 4])
    with pytest.raises(ValueError, match="distinct lines in 0..3"):
        session.prefill_lines(chunk, [0, 4], [0, 0], [4, 4])
    with pytest.raises(ValueError, match="last_index in 0..7"):
        session.prefill_lines(chunk, [0, 1], [0, 0], [4, 8])
    with pytest.raises(ValueError, match="below n_positions 64"):
        session.prefill_lines(chunk, [0, 1], [0, 60], [4, 4])
    with pytest.raises(ValueError, match="slots >= 0"):
        session.prefill_lines(chunk, [0, 1], [0, -1], [4, 4])


def test_prompts_arriving_together_are_prefilled_together_and_get_their_tokens_alone(tiny_llama):
    """Eight prompts into four lines: the chunks of one width run in one program, a short
    prompt is not padded to a long one's chunk, and every request gets the greedy tokens
    HF transformers gives its prompt alone."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path)
    session = model.session
    assert session.batched_prefill_buckets() == [8, 16]
    calls = []
    prefill_lines = session.prefill_lines

    def recorded(tokens, lines, *rest, **options):
        calls.append((tokens.shape[1], len(lines)))
        return prefill_lines(tokens, lines, *rest, **options)

    session.prefill_lines = recorded
    rng = np.random.default_rng(1)
    lengths = [5, 7, 14, 30, 3, 12, 9, 40]
    batcher = ContinuousBatcher(model)
    requests = [batcher.submit(rng.integers(1, 320, n).tolist(), max_new_tokens=6) for n in lengths]
    while batcher.busy:
        batcher.step()
    for request in requests:
        assert request.finish_reason == "length"
        assert request.tokens == hf_greedy(hf, request.prompt, 6), request.id
    # The first step: the 5- and 7-token prompts in one chunk of 8, the 14- and 30-token ones
    # in one chunk of 16.
    assert calls[:2] == [(8, 2), (16, 2)]
    assert max(k for _, k in calls) >= 2


def test_a_failing_batched_chunk_fails_its_requests_only(tiny_llama):
    """The program of one width's chunks fails: its requests end with the error, those whose
    chunks ran in another program (or that decode) go on to their greedy tokens; a request's
    own failure (choosing its token) in a chunk shared with others ends that request alone."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path)
    session = model.session
    batcher = ContinuousBatcher(model)
    prompts = [[5, 6, 7, 8], list(range(10, 24)), [40, 41, 42], list(range(50, 62))]
    prefill_lines = session.prefill_lines

    def failing(tokens, lines, *rest, **options):
        if tokens.shape[1] == 16:
            raise RuntimeError("the chunk program failed")
        return prefill_lines(tokens, lines, *rest, **options)

    choose = batcher._choose

    def failing_choice(request, logits):
        if request.prompt == prompts[2]:
            raise FloatingPointError("the sampler failed")
        return choose(request, logits)

    session.prefill_lines, batcher._choose = failing, failing_choice
    requests = [batcher.submit(prompt, max_new_tokens=8) for prompt in prompts]
    for _ in range(100):
        if not batcher.busy:
            break
        batcher.step()
    assert not batcher.busy
    for i in (1, 3):
        assert requests[i].finish_reason == "error" and "the chunk program failed" in requests[i].error
        assert requests[i].tokens == []
    assert requests[2].finish_reason == "error" and "the sampler failed" in requests[2].error
    assert requests[0].finish_reason == "length" and requests[0].tokens == hf_greedy(hf, prompts[0], 8)
