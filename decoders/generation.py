"""One call of sample(): prefill in context-bucket chunks, then token-by-token decode.

Lines are left-padded so that every line writes the same cache slot at each step.
The new token ids go straight from the sampler into the next embed call on the
device; the host downloads only the ids (for EOS, streamers, stopping criteria).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from decoders import buckets as bucketing
from decoders.inputs import Prompts


def _rng_state(seed: int | None) -> np.ndarray:
    entropy = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    return np.random.SeedSequence(entropy).generate_state(4, dtype=np.uint32).reshape(2, 2)


def banned_ngram_tokens(tokens: list[int], n: int) -> set[int]:
    """Tokens that would complete an n-gram already present in `tokens` (HF semantics)."""
    if len(tokens) < n:
        return set()
    prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
    banned = set()
    for start in range(len(tokens) - n + 1):
        if tuple(tokens[start:start + n - 1]) == prefix:
            banned.add(tokens[start + n - 1])
    return banned


class Generation:
    def __init__(self, model: Any, prompts: Prompts, top_k: list, top_p: list, temperature: list,
                 seed: int | None, no_repeat_ngram_size: int | None):
        self.model = model
        self.backend = model.programs.backend
        self.prompts = prompts
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.scores: list[np.ndarray] | None = None
        self.greedy = all(int(k) == 1 for k in top_k)
        self.pads = prompts.pads()
        self.pad_buffer = self.backend.to_device(self.pads)
        if not self.greedy:
            vocab = model.dims.vocab_size
            configured = model.neuron_config.on_device_generation
            bound = configured.global_top_k if configured and configured.global_top_k else None
            wanted = max(int(k) for k in top_k)
            k_max = min(vocab, bound or max(64, 1 << (wanted - 1).bit_length()))
            if wanted > k_max:
                raise ValueError(f"top_k {wanted} exceeds global_top_k {k_max}")
            self.sampler = model.program("sampler", k_max)
            self.sampling_inputs = {
                "top_k": self.backend.to_device(np.asarray(top_k, np.int32)),
                "top_p": self.backend.to_device(np.asarray(top_p, np.float32)),
                "temperature": self.backend.to_device(np.asarray(temperature, np.float32)),
                "rng_state": self.backend.to_device(_rng_state(seed)),
            }
        else:
            self.sampler = model.program("greedy")

    # -- programs ----------------------------------------------------------------
    def _layers(self, hidden: Any, n_tokens: int, n_attend: int, positions: np.ndarray, slot: int) -> Any:
        model = self.model
        block = model.program("block", n_tokens, n_attend)
        cache = model.kv_cache
        step = {"positions": self.backend.to_device(positions),
                "slot": self.backend.to_device(np.int32(slot)), "pad": self.pad_buffer}
        # Checked once through the named path; the other layers reuse the same order.
        names = block.program.param_names
        first = block.arguments({**model._weights[0], **step, "hidden": hidden,
                                 "cache_k": cache.keys[0], "cache_v": cache.values[0]})
        hidden, cache.keys[0], cache.values[0] = block.run(first)
        at_hidden, at_k, at_v = names.index("hidden"), names.index("cache_k"), names.index("cache_v")
        for layer in range(1, len(model._weights)):
            args = self._layer_arguments(block, layer, step)
            args[at_hidden], args[at_k], args[at_v] = hidden, cache.keys[layer], cache.values[layer]
            hidden, cache.keys[layer], cache.values[layer] = block.run_buffers(args)
        return hidden

    def _layer_arguments(self, block: Any, layer: int, step: dict[str, Any]) -> list[Any]:
        """Layer `layer`'s arguments in the block's order, hidden and caches still to fill."""
        weights = self.model._weights[layer]
        return [weights.get(name) if name in weights else step.get(name) for name in block.program.param_names]

    def _positions(self, n_tokens: int, slot: int) -> np.ndarray:
        """Rotary positions of n_tokens written at `slot`: slot minus each line's left padding."""
        slots = slot + np.arange(n_tokens, dtype=np.int32)[None, :]
        return np.maximum(slots - self.pads[:, None], 0).astype(np.int32)

    def _forward(self, token_ids: Any, n_tokens: int, n_attend: int, slot: int, last_index: int) -> Any:
        """Run the model over n_tokens per line written at `slot`; logits of `last_index`."""
        model = self.model
        if model.whole_model and n_tokens == 1:
            return self._forward_whole(token_ids, n_tokens, n_attend, slot, last_index)
        embed = model.program("embed", n_tokens)
        hidden = embed.run(embed.arguments({"token_ids": token_ids, **model._shared}))[0]
        positions = self._positions(n_tokens, slot)
        hidden = self._layers(hidden, n_tokens, n_attend, positions, slot)
        head = model.program("lm_head", n_tokens)
        last = self.backend.to_device(np.full((model.batch_size,), last_index, np.int32))
        return head.run(head.arguments({"hidden": hidden, "last_index": last, **model._shared}))[0]

    def _forward_whole(self, token_ids: Any, n_tokens: int, n_attend: int, slot: int, last_index: int) -> Any:
        """A decode step as one unrolled program (NeuronConfig.whole_model_program)."""
        model, cache = self.model, self.model.kv_cache
        program = model.program("model_step", n_tokens, n_attend)
        values = {
            "token_ids": token_ids, "pad": self.pad_buffer, **model._shared,
            "positions": self.backend.to_device(self._positions(n_tokens, slot)),
            "slot": self.backend.to_device(np.int32(slot)),
            "last_index": self.backend.to_device(np.full((model.batch_size,), last_index, np.int32)),
        }
        for layer, weights in enumerate(model._weights):
            values.update({f"layer{layer}.{name}": buffer for name, buffer in weights.items()})
            values[f"layer{layer}.cache_k"] = cache.keys[layer]
            values[f"layer{layer}.cache_v"] = cache.values[layer]
        logits, *caches = program.run(program.arguments(values))
        cache.keys[:] = caches[0::2]
        cache.values[:] = caches[1::2]
        return logits

    def _next_tokens(self, logits: Any, lines: list[list[int]]) -> Any:
        if self.scores is not None:
            self.scores.append(np.array(self.backend.to_host(logits), copy=True))
        if self.no_repeat_ngram_size:
            host = np.array(self.backend.to_host(logits), copy=True)
            for i, line in enumerate(lines):
                banned = list(banned_ngram_tokens(line, self.no_repeat_ngram_size))
                host[i, banned] = -np.inf
            logits = self.backend.to_device(host)
        args = self.sampler.arguments({"logits": logits, **getattr(self, "sampling_inputs", {})})
        outputs = self.sampler.run(args)
        if len(outputs) > 1:
            self.sampling_inputs["rng_state"] = outputs[1]
        return outputs[0]

    def _prefill(self) -> Any:
        model, prompts = self.model, self.prompts
        longest = prompts.longest
        block_ids = prompts.left_padded()
        largest = model.context_buckets[-1]
        start = 0
        while True:
            remaining = longest - start
            size = bucketing.pick(model.context_buckets, remaining) if remaining <= largest else largest
            start = min(start, model.n_positions - size)
            ids = np.zeros((model.batch_size, size), np.int32)
            chunk = block_ids[:, start:start + size]
            ids[:, : chunk.shape[1]] = chunk
            n_attend = size if start == 0 else bucketing.pick(model.token_buckets, start + size)
            last = start + size >= longest
            logits = self._forward(self.backend.to_device(ids), size, n_attend, start,
                                   longest - 1 - start if last else size - 1)
            if last:
                return logits
            start += size

    # -- the loop ----------------------------------------------------------------
    def run(self, sequence_length: int, eos_ids: list[int], streamer: Any, stopping_criteria: Any) -> list[list[int]]:
        import torch

        model, prompts = self.model, self.prompts
        lines = [list(line) for line in prompts.lines]
        done = [False] * model.batch_size
        if streamer is not None:
            streamer.put(torch.tensor(prompts.left_padded(), dtype=torch.long))
        slot = prompts.longest  # where the next drawn token goes
        if slot < sequence_length:
            logits = self._prefill()
        while slot < sequence_length:
            tokens_device = self._next_tokens(logits, lines)
            tokens = np.asarray(self.backend.to_host(tokens_device)).reshape(-1)
            for i, token in enumerate(tokens):
                if not done[i]:
                    lines[i].append(int(token))
                    done[i] = int(token) in eos_ids
            if streamer is not None:
                streamer.put(torch.tensor(tokens.reshape(-1, 1), dtype=torch.long))
            done = self._check_stopping(stopping_criteria, lines, done, eos_ids)
            if all(done) or slot + 1 >= sequence_length:
                break
            # The token just drawn sits at `slot`; its logits give the next one.
            n_attend = bucketing.pick(model.decode_buckets(), slot + 1)
            logits = self._forward(tokens_device, 1, n_attend, slot, 0)
            slot += 1
        if streamer is not None:
            streamer.end()
        return lines

    def _check_stopping(self, criteria: Any, lines: list[list[int]], done: list[bool],
                        eos_ids: list[int]) -> list[bool]:
        if not criteria:
            return done
        import torch

        width = max(len(line) for line in lines)
        pad = eos_ids[0] if eos_ids else 0
        ids = torch.full((len(lines), width), pad, dtype=torch.long)
        for i, line in enumerate(lines):
            ids[i, : len(line)] = torch.tensor(line)
        for criterion in criteria:
            verdict = criterion(ids, None)
            if isinstance(verdict, torch.Tensor):
                flags = verdict.reshape(-1).tolist()
                if len(flags) == 1:
                    flags = flags * len(lines)
            else:
                flags = [bool(verdict)] * len(lines)
            done = [d or bool(f) for d, f in zip(done, flags)]
        return done
