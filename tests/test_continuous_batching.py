"""Continuous batching: sequences at their own lengths in the lines of one batch, each giving
exactly the greedy tokens HF transformers gives it alone; transformers-neuronx's forward()
with seq_ids; the batcher that admits and retires requests while the batch runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoders import ContinuousBatchingConfig, LlamaForSampling, NeuronConfig
from serving.scheduler import ContinuousBatcher

SHAPE = dict(n_positions=64, context_length_estimate=[8, 16])


def batched_model(path, lines: int = 4, **options):
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=lines),
                          **options)
    return LlamaForSampling.from_pretrained(path, batch_size=lines, neuron_config=config, **SHAPE).to_neuron()


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernels", [None, False])
def test_forward_with_seq_ids_runs_sequences_at_their_own_lengths(tiny_llama, kernels):
    """transformers-neuronx's API: a prompt prefilled into line 2 while line 0 is mid-decode,
    then both decoded in one call, each at its own cache position."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path, cpu_kernels=kernels)
    first, second = list(range(5, 24)), [30, 31, 32]
    logits = model.forward(torch.tensor([first]), torch.tensor([list(range(len(first)))]), torch.tensor([0]))
    assert logits.shape == (1, 320)
    got_first = [int(logits[0].argmax())]
    for step in range(5):
        logits = model.forward(torch.tensor([[got_first[-1]]]), torch.tensor([[len(first) + step]]),
                               torch.tensor([0]))
        got_first.append(int(logits[0].argmax()))
    got_second = [int(model.forward(torch.tensor([second]), None, torch.tensor([2]))[0].argmax())]
    for step in range(12):
        logits = model.forward(torch.tensor([[got_second[-1]], [got_first[-1]]]),
                               torch.tensor([[len(second) + step], [len(first) + 5 + step]]),
                               torch.tensor([2, 0]))
        got_second.append(int(logits[0].argmax()))
        got_first.append(int(logits[1].argmax()))
    assert got_first == hf_greedy(hf, first, 18)
    assert got_second == hf_greedy(hf, second, 13)


def test_a_prompt_chunk_runs_in_a_program_for_its_line_alone(tiny_llama):
    """Session.prefill_line: a chunk written into one line gives the logits the every-line
    program gives that line, and leaves the other lines' caches as they were, bit for bit."""
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path)
    session = model.session
    assert session.row_prefill
    first = list(range(5, 24))
    model.forward(torch.tensor([first]), torch.tensor([list(range(len(first)))]), torch.tensor([0]))
    host = session.placement.host

    def caches():
        return [host(c) for c in (*session.kv_cache.keys, *session.kv_cache.values)]

    before = caches()
    chunk = np.zeros((1, 16), np.int32)
    chunk[0, :11] = np.arange(40, 51)
    alone = session.host_logits(session.prefill_line(chunk, 2, 0, 10))[0]
    after = caches()
    for old, new in zip(before, after):
        others = [0, 1, 3]
        assert np.array_equal(old[others], new[others])
        assert not np.array_equal(old[2], new[2])
    # The same chunk through the program over every line, into line 3 (line 2's twin).
    tokens = np.zeros((4, 16), np.int32)
    tokens[3] = chunk[0]
    slots = np.full(4, session.n_positions, np.int32)
    slots[3] = 0
    last = np.zeros(4, np.int32)
    last[3] = 10
    together = session.host_logits(session.step_every_line(tokens, slots, last))[3]
    np.testing.assert_allclose(alone, together, rtol=1e-5, atol=1e-5)
    for cache in caches():
        np.testing.assert_allclose(cache[2, :, :11], cache[3, :, :11], rtol=1e-6, atol=1e-6)
    # One token for lines 2 and 3 (twins so far) through the two-row programs, then the same
    # tokens at the same slots through the every-line program: the same logits, row by row.
    before = caches()
    paired = session.host_logits(session.decode_lines(np.array([7, 8]), np.array([2, 3]), np.array([11, 11])))
    for old, new in zip(before, caches()):
        assert np.array_equal(old[[0, 1]], new[[0, 1]])
    tokens = np.zeros((4, 1), np.int32)
    tokens[2:, 0] = [7, 8]
    slots = np.array([session.n_positions, session.n_positions, 11, 11], np.int32)
    every = session.host_logits(session.step_every_line(tokens, slots, np.zeros(4, np.int32)))
    np.testing.assert_allclose(paired, every[2:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(paired[0], paired[1], atol=1e-3)
    with pytest.raises(ValueError, match="rows one of"):
        session.decode_lines(np.zeros(3, np.int32), np.array([0, 1, 2]), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="context bucket"):
        session.prefill_line(np.zeros((1, 5), np.int32), 2, 0, 4)
    with pytest.raises(ValueError, match="line in 0..3"):
        session.prefill_line(chunk, 4, 0, 10)


def test_twelve_sequences_through_four_lines_each_get_their_greedy_tokens_alone(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path)
    batcher = ContinuousBatcher(model)
    rng = np.random.default_rng(0)
    lengths = [1, 3, 7, 8, 9, 15, 16, 17, 25, 33, 4, 12]          # under, at and over the buckets; chunked
    budgets = [20, 5, 12, 30, 8, 16, 3, 24, 10, 6, 28, 14]
    requests, streamed = [], {}
    # Prompt chunks go through the programs for their lines only; the every-line program only decodes.
    widths, chunks = [], []
    every_line, some_lines = model.session.step_every_line, model.session.prefill_lines
    model.session.step_every_line = (
        lambda tokens, *rest: widths.append(tokens.shape[1]) or every_line(tokens, *rest))
    model.session.prefill_lines = (
        lambda tokens, *rest, **options: chunks.append(tokens.shape) or some_lines(tokens, *rest, **options))
    # Decode steps with one or two active lines run the programs for that many rows.
    row_steps, some_rows = [], model.session.decode_lines
    model.session.decode_lines = (
        lambda tokens, *rest: row_steps.append(len(tokens)) or some_rows(tokens, *rest))

    def on_token(request, token):
        streamed.setdefault(request.id, []).append(token)

    for length, budget in zip(lengths, budgets):
        prompt = rng.integers(1, 320, length).tolist()
        requests.append(batcher.submit(prompt, max_new_tokens=budget, on_token=on_token))
    most_active = 0
    while batcher.busy:
        batcher.step()
        most_active = max(most_active, batcher.active)
    assert most_active == 4
    for request in requests:
        assert request.finish_reason == "length"
        assert request.tokens == hf_greedy(hf, request.prompt, request.max_new_tokens), request.id
        assert streamed[request.id] == request.tokens
    # Steps ran lines together: far fewer than one request after another would take.
    alone = sum(-(-length // 16) + budget - 1 for length, budget in zip(lengths, budgets))
    assert batcher.steps < 0.5 * alone, (batcher.steps, alone)
    assert set(widths) == {1} and sum(k for k, _ in chunks) >= sum(length > 1 for length in lengths)
    assert max(k for k, _ in chunks) > 1                   # prompts arriving together: one program
    assert model.session.decode_rows() == [1, 2] and set(row_steps) == {1, 2}
    assert batcher.prompt_tokens_written + batcher.prompt_tokens_reused == sum(lengths)


def test_a_request_that_arrives_later_joins_a_running_batch(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batcher = ContinuousBatcher(batched_model(path, lines=2))
    early = batcher.submit([5, 6, 7], max_new_tokens=20)
    for _ in range(6):
        batcher.step()
    late = batcher.submit(list(range(40, 60)), max_new_tokens=10)      # chunked while `early` decodes
    while batcher.busy:
        batcher.step()
    assert early.tokens == hf_greedy(hf, [5, 6, 7], 20)
    assert late.tokens == hf_greedy(hf, list(range(40, 60)), 10)


def test_eos_cancel_and_the_end_of_the_cache_free_their_lines(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batcher = ContinuousBatcher(batched_model(path, lines=2))
    expected = hf_greedy(hf, [5, 6, 7], 10)
    stops = batcher.submit([5, 6, 7], max_new_tokens=10, eos_token_ids=(expected[3],))
    long = batcher.submit(list(range(1, 50)), max_new_tokens=100)
    cancelled = batcher.submit([9, 9, 9], max_new_tokens=10)
    batcher.cancel(cancelled)
    while batcher.busy:
        batcher.step()
    assert stops.finish_reason == "stop" and stops.tokens == expected[:expected.index(expected[3]) + 1]
    assert long.finish_reason == "length" and long.length == 64       # n_positions
    assert long.tokens == hf_greedy(hf, list(range(1, 50)), 15)
    assert cancelled.finish_reason == "cancelled" and cancelled.tokens == []


def test_a_failing_request_ends_alone_and_its_neighbours_get_their_greedy_tokens(tiny_llama):
    """A failure in one request's token choice, its callback, or a prompt chunk's program
    that request alone ran ends that request with an error; the others run on to the tokens
    they get alone (prompts[3] is the only one whose first chunk is 16 wide)."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path)
    batcher = ContinuousBatcher(model)
    prompts = [[5, 6, 7], list(range(10, 15)), [40, 41], list(range(50, 70)), [8, 9, 10, 11], [3, 4]]

    def on_token(request, token):
        if request.prompt == prompts[1] and len(request.tokens) == 3:
            raise RuntimeError("a callback failed")

    choose = batcher._choose

    def failing_choice(request, logits):
        if request.prompt == prompts[2] and len(request.tokens) == 5:
            raise FloatingPointError("the sampler failed")
        return choose(request, logits)

    prefill_lines = model.session.prefill_lines

    def failing_chunk(tokens, lines, *rest, **options):
        if any(batcher.lines[line].prompt == prompts[3] for line in lines):
            raise RuntimeError("this prompt's chunk failed")
        return prefill_lines(tokens, lines, *rest, **options)

    batcher._choose, model.session.prefill_lines = failing_choice, failing_chunk
    requests = [batcher.submit(prompt, max_new_tokens=12, on_token=on_token) for prompt in prompts]
    for _ in range(200):
        if not batcher.busy:
            break
        batcher.step()
    assert not batcher.busy
    failed = {1: "a callback failed", 2: "the sampler failed", 3: "this prompt's chunk failed"}
    for i, request in enumerate(requests):
        if i in failed:
            assert request.finish_reason == "error" and failed[i] in request.error, (i, request.error)
        else:
            assert request.finish_reason == "length" and request.error is None
            assert request.tokens == hf_greedy(hf, request.prompt, 12), i
    assert requests[1].tokens == hf_greedy(hf, prompts[1], 3)      # what it had when its callback failed


def test_a_failing_shared_step_ends_the_requests_in_it_and_the_batcher_goes_on(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path, lines=2)
    batcher = ContinuousBatcher(model)
    failed = []

    def fails_once(program):
        def run(*args):
            if not failed:                   # the first step over both lines, in either program
                failed.append(1)
                raise RuntimeError("the device step failed")
            return program(*args)
        return run

    session = model.session
    session.decode_lines, session.step_every_line = map(fails_once, (session.decode_lines,
                                                                     session.step_every_line))
    first = [batcher.submit([5, 6, 7], max_new_tokens=8), batcher.submit([9, 10], max_new_tokens=8)]
    waiting = batcher.submit([20, 21, 22], max_new_tokens=8)
    for _ in range(100):
        if not batcher.busy:
            break
        batcher.step()
    assert not batcher.busy
    for request in first:
        assert request.finish_reason == "error" and "the device step failed" in request.error
        assert 1 <= len(request.tokens) < 8
        assert request.tokens == hf_greedy(hf, request.prompt, len(request.tokens))
    # The failed lines' caches are not trusted: only the line `waiting` used since keeps a prefix.
    assert sorted(kept[:3] for kept in batcher.kept) == [[], [20, 21, 22]]
    assert waiting.finish_reason == "length" and waiting.tokens == hf_greedy(hf, [20, 21, 22], 8)
    again = batcher.submit([5, 6, 7], max_new_tokens=8)          # no stale prefix is reused
    for _ in range(100):
        if not batcher.busy:
            break
        batcher.step()
    assert again.reused == 0 and again.tokens == hf_greedy(hf, [5, 6, 7], 8)


def test_a_failed_step_leaves_no_prefix_claims(tiny_llama):
    """A prompt token counts as written (and may be kept as a line's prefix) only once the
    program that writes it has succeeded: after a failed step, in the program over every line
    or in the one for a few rows, no request claims tokens in the cache and no line keeps any."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path, lines=2)
    batcher = ContinuousBatcher(model)
    session = model.session
    programs = {"decode_lines": session.decode_lines, "step_every_line": session.step_every_line}

    def failing(*args):
        raise RuntimeError("the device step failed")

    session.decode_lines = session.step_every_line = failing
    # One-token prompts: their only token goes into the decode step. Two lines: the program
    # over every line; then one line alone: the program for one row.
    both = [batcher.submit([5], max_new_tokens=4), batcher.submit([9], max_new_tokens=4)]
    batcher.step()
    alone = batcher.submit([7], max_new_tokens=4)
    batcher.step()
    for request in [*both, alone]:
        assert request.finish_reason == "error" and "the device step failed" in request.error
        assert request.written == 0 and request.tokens == []
    assert batcher.prompt_tokens_written == 0 and batcher.kept == [[], []] and not batcher.busy
    session.decode_lines, session.step_every_line = programs["decode_lines"], programs["step_every_line"]
    again = batcher.submit([5, 6, 7], max_new_tokens=6)
    for _ in range(50):
        if not batcher.busy:
            break
        batcher.step()
    assert again.reused == 0 and again.tokens == hf_greedy(hf, [5, 6, 7], 6)
    assert batcher.prompt_tokens_written == 3


def test_extreme_sampling_values_choose_tokens_without_raising(tiny_llama):
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batcher = ContinuousBatcher(batched_model(path))
    greedy = hf_greedy(hf, [5, 6, 7], 6)
    settings = [dict(temperature=1e-40), dict(temperature=1e-30, top_p=1e-9),
                dict(temperature=1.0, top_p=1e-9), dict(temperature=1e30),
                dict(temperature=1e30, top_k=1), dict(temperature=4e-6, top_k=3)]
    requests = [batcher.submit([5, 6, 7], max_new_tokens=6, do_sample=True, seed=1, **options)
                for options in settings]
    for _ in range(100):
        if not batcher.busy:
            break
        batcher.step()
    assert [r.finish_reason for r in requests] == ["length"] * len(settings)
    for request, options in zip(requests, settings):
        if options != dict(temperature=1e30):                 # the others leave the top token alone
            assert request.tokens == greedy, options
    assert all(0 <= t < 320 for t in requests[3].tokens)


def test_sampling_with_a_seed_reproduces(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    model = batched_model(path, lines=2)
    runs = []
    for seeds in ((7, 8), (7, 8), (9, 8)):
        batcher = ContinuousBatcher(model)
        made = [batcher.submit([5, 6, 7], max_new_tokens=25, do_sample=True, top_k=50, top_p=0.9,
                               temperature=1.3, seed=seed) for seed in seeds]
        while batcher.busy:
            batcher.step()
        runs.append([r.tokens for r in made])
    assert runs[0] == runs[1]
    assert runs[2][0] != runs[0][0] and runs[2][1] == runs[0][1]


def test_sample_still_runs_a_whole_batch(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13], [14, 15, 16]]
    plain = LlamaForSampling.from_pretrained(path, batch_size=4, **SHAPE).to_neuron()
    expected = plain.sample(prompts, sequence_length=30, top_k=1, eos_token_id=[])
    assert torch.equal(batched_model(path).sample(prompts, sequence_length=30, top_k=1, eos_token_id=[]),
                       expected)


def test_bad_continuous_batching_input_is_a_clear_error(tiny_llama):
    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    with pytest.raises(ValueError, match="must equal batch_size=2"):
        LlamaForSampling.from_pretrained(path, batch_size=2, neuron_config=NeuronConfig(
            continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=4)), **SHAPE)
    with pytest.raises(ValueError, match="batch_size_for_shared_caches must be an int"):
        ContinuousBatchingConfig(batch_size_for_shared_caches=0)
    model = batched_model(path, lines=2)
    with pytest.raises(ValueError, match="needs start_ids=seq_ids"):
        model.forward(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="distinct batch lines in 0..1"):
        model.forward(torch.tensor([[1, 2, 3]]), None, torch.tensor([2]))
    with pytest.raises(ValueError, match="consecutive positions"):
        model.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 2, 3]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="cache_ids is needed"):
        model.forward(torch.tensor([[1]]), None, torch.tensor([0]))
    batcher = ContinuousBatcher(model)
    with pytest.raises(ValueError, match="at most 63"):
        batcher.submit(list(range(1, 65)), max_new_tokens=1)
    with pytest.raises(ValueError, match="ContinuousBatcher needs"):
        ContinuousBatcher(LlamaForSampling.from_pretrained(path, **SHAPE))
    with pytest.raises(ValueError, match="step_every_line\\(\\) needs"):
        LlamaForSampling.from_pretrained(path, **SHAPE).session.step_every_line(np.zeros((1, 1)), [0], [0])


def two_long_lines(path):
    """A continuous-batching model of 2 lines of 256 positions, prompts in chunks of 16 and 64."""
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=2))
    model = LlamaForSampling.from_pretrained(path, batch_size=2, n_positions=256,
                                             context_length_estimate=[16, 64], neuron_config=config)
    return model.to_neuron()


def test_a_prompt_sharing_a_cached_prefix_computes_only_the_rest(tiny_llama):
    """Prefix caching: a second request sharing a 100-token prefix reuses it (counted by the
    batcher), with the tokens HF gives it alone; a chat's next turn reuses the whole first
    exchange; an unrelated request takes the least recently used line."""
    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batcher = ContinuousBatcher(two_long_lines(path))
    prefix = np.random.default_rng(1).integers(1, 320, 100).tolist()

    def run(prompt, new_tokens):
        request = batcher.submit(prompt, max_new_tokens=new_tokens)
        while batcher.busy:
            batcher.step()
        return request

    first = run(prefix + [7, 8, 9], 10)
    assert first.reused == 0 and batcher.prompt_tokens_written == 103
    second = run(prefix + [11, 12], 12)
    assert second.reused == 100 and second.line == first.line
    assert batcher.prompt_tokens_written == 103 + 2
    assert second.tokens == hf_greedy(hf, prefix + [11, 12], 12)

    # The next turn of a chat: the first exchange (all but its last token are in the cache).
    turn = second.prompt + second.tokens + [13, 14]
    reply = run(turn, 8)
    assert reply.reused == len(second.prompt) + len(second.tokens) - 1 and reply.line == second.line
    assert reply.tokens == hf_greedy(hf, turn, 8)

    # No shared prefix: the other line (least recently used) is taken, the chat's prefix kept.
    other = run([200, 201, 202], 5)
    assert other.reused == 0 and other.line != reply.line
    again = run(turn, 8)
    assert again.reused == len(turn) - 1 and again.tokens == reply.tokens


def test_a_prompt_sharing_a_busy_lines_prefix_starts_from_a_copy_of_it(tiny_llama):
    """A request whose prompt shares a prefix with a busy line's written prompt (and with no free
    line) starts from a copy of that line: the shared tokens are not computed, its tokens are
    HF's, and the busy line's own tokens are untouched. A shorter share is computed."""
    from serving import scheduler

    hf, path = tiny_llama("gqa_tied_llama3", "safetensors")
    batcher = ContinuousBatcher(two_long_lines(path))
    prefix = np.random.default_rng(2).integers(1, 320, 100).tolist()
    busy = batcher.submit(prefix + [7, 8, 9], max_new_tokens=20)
    while busy.written < len(busy.prompt):
        batcher.step()
    written = batcher.prompt_tokens_written
    copied = batcher.submit(prefix + [11, 12], max_new_tokens=12)
    while batcher.busy:
        batcher.step()
    assert copied.line != busy.line and copied.reused == 100
    assert batcher.prompt_tokens_written == written + 2
    assert copied.tokens == hf_greedy(hf, prefix + [11, 12], 12)
    assert busy.tokens == hf_greedy(hf, prefix + [7, 8, 9], 20)

    # Sharing fewer than COPY_PREFIX_AT_LEAST tokens (and none with a free line): computed.
    short = np.random.default_rng(3).integers(1, 320, scheduler.COPY_PREFIX_AT_LEAST - 1).tolist()
    first = batcher.submit(short + [30, 31], max_new_tokens=20)
    while first.written < len(first.prompt):
        batcher.step()
    other = batcher.submit(short + [40, 41], max_new_tokens=4)
    while batcher.busy:
        batcher.step()
    assert other.reused == 0 and other.tokens == hf_greedy(hf, short + [40, 41], 4)


def test_the_configuration_round_trips_through_a_dict():
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(batch_size_for_shared_caches=4))
    again = NeuronConfig.from_dict(config.to_dict())
    assert again.continuous_batching == ContinuousBatchingConfig(batch_size_for_shared_caches=4)
