"""Speculative decoding, with transformers-neuronx's names:

    target.enable_speculative_decoder(k)          # before to_neuron(): the k+1-token check program
    generator = SpeculativeGenerator(draft, target, k)
    tokens = generator.sample(input_ids, sequence_length, top_k=1)
    generator.acceptance_rate                      # accepted draft tokens / proposed

Each round the draft model proposes k tokens one at a time; the target runs the token before
them and the k proposals in one program (Session.check_drafts) and gives its own choice after
each. Greedy: the proposals are kept while they equal the target's choices, then the
target's choice follows, so the output is the target's greedy output token for token.
Sampling: proposal i is kept with probability min(1, p_i / q_i) (p the target's, q the
draft's warped probabilities); at the first rejection a token is drawn from the normalized
max(0, p - q), and when all k are kept one more from the target's next distribution, so the
tokens follow the target's distribution (Leviathan et al. 2023; Chen et al. 2023). Each round
gives 1 to k + 1 tokens for one target call. Batch size 1.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from decoders.session import choice


def accept_drafts(drafts: list[int], draft_probs: Any, target_probs: Any, generator: Any) -> tuple[int, int]:
    """Speculative sampling's check: (how many leading drafts are kept, the token that
    follows them). draft_probs [k, vocab] are the draft's distributions the drafts were drawn
    from, target_probs [k + 1, vocab] the target's at the same positions and one more."""
    import torch

    for i, token in enumerate(drafts):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if q <= 0 or torch.rand(1, generator=generator).item() >= min(1.0, p / q):
            residual = torch.clamp(target_probs[i] - draft_probs[i], min=0)
            total = float(residual.sum())
            return i, choice.draw(residual / total if total > 0 else target_probs[i], generator)
    return len(drafts), choice.draw(target_probs[len(drafts)], generator)


class SpeculativeGenerator:
    def __init__(self, draft: Any, target: Any, k: int):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"the speculation length k must be an int >= 1, got {k!r}")
        if draft.decoder.head.vocab_size != target.decoder.head.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.decoder.head.vocab_size}) differs from the "
                             f"target's ({target.decoder.head.vocab_size}): they must share a tokenizer")
        if draft.batch_size != 1 or target.batch_size != 1:
            raise ValueError("speculative decoding runs batch_size=1 models (draft and target)")
        if target.session.speculation_length != k:
            raise ValueError(f"call target.enable_speculative_decoder({k}) before target.to_neuron()")
        self.draft, self.target, self.k = draft, target, k
        self.proposed = 0
        self.accepted = 0
        self.target_calls = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones, over every sample() call so far."""
        return self.accepted / self.proposed if self.proposed else 0.0

    def sample(self, input_ids: Any, sequence_length: int, top_k: int = 1, top_p: float = 1.0,
               temperature: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int | None = None,
               streamer: Any = None) -> Any:
        """Token ids [1, <= sequence_length]: the prompt, then the new tokens (greedy with
        top_k=1, else sampled from the target's top-k / top-p / temperature distribution)."""
        import torch

        prompt = [int(t) for t in np.asarray(input_ids.tolist() if hasattr(input_ids, "tolist")
                                             else input_ids).reshape(-1)]
        target, draft = self.target.session, self.draft.session
        limit = min(target.n_positions, draft.n_positions)
        if not prompt or not len(prompt) < sequence_length <= limit:
            raise ValueError(f"need a prompt shorter than sequence_length ({sequence_length}), which must be "
                             f"at most n_positions {limit}; the prompt has {len(prompt)} tokens")
        greedy = top_k == 1
        generator = None if greedy else choice.seeded_generator(seed)
        eos = set(self.target.eos_ids(eos_token_id))
        pads = np.zeros(1, np.int32)

        def warped(logits: np.ndarray) -> Any:
            return choice.probabilities(logits, temperature, top_k, top_p)

        def pick(probs_or_logits: Any) -> int:
            return int(np.argmax(probs_or_logits)) if greedy else choice.draw(probs_or_logits, generator)

        ids = np.array([prompt], np.int32)
        draft.run_batch(ids, 0, pads)
        first = target.host_logits(target.run_batch(ids, 0, pads))[0]
        out = [pick(first if greedy else warped(first))]
        pending, draft_slot = [out[0]], len(prompt)        # tokens the draft has not read yet, and where
                                                           # they go
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
            streamer.put(torch.tensor(out))
        while out[-1] not in eos and len(prompt) + len(out) < sequence_length:
            slot = len(prompt) + len(out) - 1               # where the target writes out[-1]
            k = min(self.k, sequence_length - len(prompt) - len(out) - 1)
            drafts, draft_probs = [], []
            for token in pending:
                fed = np.array([[token]], np.int32)
                logits = draft.host_logits(draft.run_batch(fed, draft_slot, pads))[0]
                draft_slot += 1
            for i in range(k):
                probs = None if greedy else warped(logits)
                drafts.append(pick(logits if greedy else probs))
                draft_probs.append(probs)
                if i < k - 1:
                    proposed = np.array([drafts[-1:]], np.int32)
                    logits = draft.host_logits(draft.run_batch(proposed, draft_slot, pads))[0]
                    draft_slot += 1
            checked = [out[-1], *drafts]
            # The compiled check takes k + 1 tokens: pad the last round's shorter one where the cache
            # has room.
            width = self.k + 1 if slot + self.k + 1 <= target.n_positions else len(checked)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, :len(checked)] = checked
            verdicts = target.host_logits(target.check_drafts(tokens, slot, pads))[0, :len(checked)]
            self.target_calls += 1
            if greedy:
                choices = verdicts.argmax(axis=-1)
                kept = next((i for i in range(k) if drafts[i] != choices[i]), k)
                following = int(choices[kept])
            else:
                kept, following = accept_drafts(drafts, torch.cat(draft_probs) if k else None,
                                                warped(verdicts), generator)
            self.proposed += k
            self.accepted += kept
            new = drafts[:kept] + [following]
            for j, token in enumerate(new):
                if token in eos or len(prompt) + len(out) >= sequence_length:
                    new = new[:j + 1] if token in eos else new[:j]
                    break
            out += new
            if streamer is not None and new:
                streamer.put(torch.tensor(new))
            # The draft read out[-1] and drafts[:k-1]; what it holds past the kept ones is stale.
            draft_slot = slot + 1 + min(kept, k - 1) if k else slot + 1
            pending = ([drafts[-1]] if kept == k and k else []) + [following]
        if streamer is not None:
            streamer.end()
        return torch.tensor([prompt + out])
