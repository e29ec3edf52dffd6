"""One call of sample(): prefill, then token-by-token decode, on a Session.

Lines are left-padded so that every line writes the same cache slot at each step. The new
token ids go straight from the sampler into the next step on the device; the host
downloads only the ids (for EOS, streamers, stopping criteria), and logits (under tensor
parallelism: every replica's block) only when no_repeat_ngram_size or output_scores ask
for them.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from decoders.session.inputs import Prompts
from decoders.session.session import Session
from pyhlo.ops.sampling import seed_state

# Decode steps launched ahead of the one whose tokens the host reads (when no step needs
# the host's view of the last tokens first).
STEPS_IN_FLIGHT = 2


def _rng_state(seed: int | None) -> np.ndarray:
    """The sampler's random state; unseeded, fresh bits that every process of a run shares
    (each process runs its own replicas of the same draw)."""
    from runtime import distributed

    entropy = seed if seed is not None else distributed.agreed_entropy()
    return seed_state(entropy)


def banned_ngram_tokens(tokens: list[int], n: int) -> set[int]:
    """Tokens that would complete an n-gram already present in `tokens` (HF's
    NoRepeatNGramLogitsProcessor on one line: every n-gram of the line, the prompt included)."""
    if len(tokens) < n:
        return set()
    prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
    banned = set()
    for start in range(len(tokens) - n + 1):
        if tuple(tokens[start:start + n - 1]) == prefix:
            banned.add(tokens[start + n - 1])
    return banned


def sampler_bound(top_k: list, vocab: int, global_top_k: int | None = None,
                  compiled: int | None = None) -> int | None:
    """The k_max of the sampler that runs these per-line top_k (None: all 1, the greedy program).

    global_top_k fixes it (a larger top_k is an error); else `compiled` (the bound to_neuron()
    built for the on-device settings) serves if large enough, so that changing those settings
    compiles nothing; else the next power of two of the largest top_k, at least 64.
    """
    wanted = max(int(k) for k in top_k)
    if wanted == 1:
        return None
    if global_top_k:
        if wanted > global_top_k:
            raise ValueError(f"top_k {wanted} exceeds global_top_k {global_top_k}: global_top_k bounds the "
                             "candidates every line draws from")
        return min(vocab, global_top_k)
    if compiled is not None and wanted <= compiled:
        return compiled
    return min(vocab, max(64, 1 << (wanted - 1).bit_length()))


class Generation:
    def __init__(self, session: Session, prompts: Prompts, top_k: list, top_p: list, temperature: list,
                 seed: int | None, no_repeat_ngram_size: int | None, k_max: int | None = None,
                 output_scores: bool = False):
        """k_max: the sampler's bound on top_k (sampler_bound()); None runs the greedy program."""
        self.session = session
        self.placement = session.placement
        self.prompts = prompts
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.scores: list[np.ndarray] | None = [] if output_scores else None
        # n-gram bans and scores need each step's logits on the host before the next step.
        self.host_sees_logits = bool(no_repeat_ngram_size) or output_scores
        self.pads = prompts.pads()
        self.sampling_inputs: dict[str, Any] = {}
        self.k_max = k_max
        self.sampler = session.sampler(k_max)
        if k_max is None:
            return
        self.sampling_inputs = {
            "top_k": self.placement.put(np.asarray(top_k, np.int32)),
            "top_p": self.placement.put(np.asarray(top_p, np.float32)),
            "temperature": self.placement.put(np.asarray(temperature, np.float32)),
            "rng_state": self.placement.put(_rng_state(seed)),
        }

    def _step(self, token_ids: Any, slot: int, lines: list[list[int]]) -> Any:
        """A decode step of the tokens at `slot`; the next tokens, on the device. A greedy step
        with nothing to see on the host takes the decode program's own greedy tokens."""
        logits, greedy = self.session.decode(token_ids, slot, self.pads)
        if greedy is not None and self.k_max is None and not self.host_sees_logits:
            return greedy
        return self._next_tokens(logits, lines)

    def _next_tokens(self, logits: Any, lines: list[list[int]]) -> Any:
        if self.scores is not None:
            self.scores.append(self.session.host_logits(logits))
        if self.no_repeat_ngram_size:
            host = self.session.host_logits(logits)
            for i, line in enumerate(lines):
                banned = list(banned_ngram_tokens(line, self.no_repeat_ngram_size))
                host[i, banned] = -np.inf
            logits = self.session.device_logits(host)
        outputs = self.sampler.run_checked_once({"logits": logits, **self.sampling_inputs})
        if "rng_state" in outputs:
            self.sampling_inputs["rng_state"] = outputs["rng_state"]
        return outputs["tokens"]

    def run(self, new_tokens: int, eos_ids: list[int], streamer: Any,
            stopping_criteria: Any) -> list[list[int]]:
        """Up to `new_tokens` new tokens per line (fewer where every line has stopped)."""
        import torch

        session, prompts = self.session, self.prompts
        # Each output line so far, for n-gram bans: as HF's processor sees the row, a padded
        # tensor's padding included.
        heads = prompts.given.tolist() if prompts.given is not None else prompts.lines
        lines = [[int(t) for t in head] for head in heads]
        generated: list[list[int]] = [[] for _ in lines]
        done = [False] * session.batch_size
        if streamer is not None:
            streamer.put(torch.as_tensor(prompts.as_given(), dtype=torch.long))
        if new_tokens < 1:
            if streamer is not None:
                streamer.end()
            return generated
        logits = session.run_batch(prompts.left_padded(), 0, self.pads)
        newest = self._next_tokens(logits, lines)      # the last launched step's tokens (on the device)
        self.placement.start_host_copy(newest)
        pending = deque([newest])                       # launched steps' tokens not read yet, oldest first
        slot = prompts.longest                          # where `newest` goes when it is fed back
        # Without n-gram bans (and scores to keep) a step needs nothing from the host: up to
        # STEPS_IN_FLIGHT steps are launched before the oldest one's tokens are read back, so
        # the host's work (streamers, stopping criteria, launches) overlaps the device's. Steps
        # launched past the last token are dropped; they wrote only cache slots past the output.
        depth = 0 if self.host_sees_logits else STEPS_IN_FLIGHT
        launched = 1
        for _ in range(new_tokens):
            while len(pending) <= depth and launched < new_tokens:
                newest = self._step(newest, slot, lines)
                self.placement.start_host_copy(newest)
                pending.append(newest)
                slot += 1
                launched += 1
            tokens = np.asarray(self.placement.host(pending.popleft())).reshape(-1)
            for i, token in enumerate(tokens):
                if not done[i]:
                    lines[i].append(int(token))
                    generated[i].append(int(token))
                    done[i] = int(token) in eos_ids
            if streamer is not None:
                streamer.put(torch.tensor(tokens.reshape(-1, 1), dtype=torch.long))
            done = self._check_stopping(stopping_criteria, generated, done, eos_ids)
            if all(done):
                break
        if streamer is not None:
            streamer.end()
        return generated

    def _check_stopping(self, criteria: Any, generated: list[list[int]], done: list[bool],
                        eos_ids: list[int]) -> list[bool]:
        if not criteria:
            return done
        import torch

        ids = torch.from_numpy(self.prompts.layout(generated, eos_ids[0] if eos_ids else 0))
        for criterion in criteria:
            verdict = criterion(ids, None)
            if isinstance(verdict, torch.Tensor):
                flags = verdict.reshape(-1).tolist()
                if len(flags) == 1:
                    flags = flags * len(generated)
            else:
                flags = [bool(verdict)] * len(generated)
            done = [d or bool(f) for d, f in zip(done, flags)]
        return done
