"""HuggingFaceGenerationModelAdapter: HF transformers' own generate() on a compiled model.

    model = LlamaForSampling.from_pretrained(path, batch_size=3, n_positions=256).to_neuron()
    adapter = HuggingFaceGenerationModelAdapter(model.config, model)
    out = adapter.generate(input_ids, attention_mask=mask, do_sample=True, top_k=50, max_new_tokens=64)

The config is an HF PreTrainedConfig (AutoConfig.from_pretrained(path) of an HF directory) or
the checkpoint's own config dict, `model.config`, which a GGUF file has too.

As in transformers-neuronx, generate()'s loop, logits processors, stopping criteria and
streamers run on the host around `model.forward(input_ids, cache_ids, start_ids)`: the
prompt once, then one token per step. Keys and values stay in the model's KV cache, so
generate() builds no cache of its own; cache positions come from the number of tokens seen,
left padding (`start_ids`) from the attention mask. Greedy and multinomial sampling are
supported; beam search (which reorders the cache between beams) is refused.
"""
from __future__ import annotations

import copy
import pathlib
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from decoders.config import NotSupportedYet


class HuggingFaceGenerationModelAdapter(PreTrainedModel, GenerationMixin):
    """An HF PreTrainedModel whose forward() runs `model` (a *ForSampling after to_neuron())."""

    # The KV cache lives in the compiled model and only moves forward: no beam reordering, no
    # rollback for assisted decoding.
    _supported_generation_modes = (GenerationMode.GREEDY_SEARCH.value, GenerationMode.SAMPLE.value)
    _is_stateful = True

    def __init__(self, config: PreTrainedConfig | dict, model: Any):
        if isinstance(config, dict):
            fields = {k: v for k, v in config.items() if k != "model_type"}
            config = AutoConfig.for_model(config["model_type"], **fields)
        # A copy: the config may be shared with a PyTorch model. Attention and experts run in the
        # compiled model; "eager" only keeps PreTrainedModel from checking for SDPA or grouped-mm
        # implementations of its own.
        config = copy.deepcopy(config)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        super().__init__(config)
        self.model = model
        self.cur_len = 0
        self._return_sequences = 1
        path = pathlib.Path(getattr(model, "checkpoint_path", "") or "")
        if (path / "generation_config.json").is_file():
            # HF's from_pretrained() takes generate()'s defaults from there too.
            self.generation_config = GenerationConfig.from_pretrained(path)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")       # logits come back to the host

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def reset_generation(self) -> None:
        """Forget the tokens seen: the next forward starts a new sequence at cache position 0."""
        self.cur_len = 0

    def generate(self, *args: Any, **kwargs: Any):
        """HF's generate(); each call starts a new sequence (transformers-neuronx keeps it stateless too)."""
        self.reset_generation()
        config = (kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
                  or self.generation_config)
        num_beams = int(kwargs.get("num_beams") or config.num_beams or 1)
        if num_beams > 1:
            raise NotSupportedYet(f"beam search (num_beams={num_beams}) is not supported yet: it reorders "
                                  "the KV cache between beams; use greedy search or sampling (num_beams=1)")
        self._return_sequences = int(kwargs.get("num_return_sequences") or config.num_return_sequences or 1)
        return super().generate(*args, **kwargs)

    def _validate_generated_length(self, generation_config: GenerationConfig, *args: Any, **kwargs: Any):
        super()._validate_generated_length(generation_config, *args, **kwargs)
        n_positions = self.model.n_positions
        if generation_config.max_length is not None and generation_config.max_length > n_positions:
            raise ValueError(f"generate() would run to max_length={generation_config.max_length} but the "
                             f"model holds n_positions={n_positions} tokens; lower max_length / "
                             "max_new_tokens or build the model with a larger n_positions")

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor,
                                      attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        lines, length = input_ids.shape
        batch_size = self.model.batch_size
        if lines != batch_size:
            raise ValueError(
                f"generate() runs {lines} batch lines ({lines // self._return_sequences} prompts x "
                f"num_return_sequences={self._return_sequences}) but the model was compiled for "
                f"batch_size={batch_size}: build it with batch_size={lines}, or give "
                f"{batch_size // self._return_sequences or 1} prompts"
            )
        start_ids = (None if attention_mask is None
                     else self._start_ids(attention_mask, check=self.cur_len == 0))
        seen = self.cur_len if 0 < self.cur_len < length else 0
        self.cur_len = length
        return {"input_ids": input_ids[:, seen:], "cache_ids": torch.arange(seen, length, dtype=torch.int32),
                "start_ids": start_ids}

    @staticmethod
    def _start_ids(attention_mask: torch.Tensor, check: bool) -> torch.Tensor:
        """Per line, the offset of its first real token; the mask must mark left padding."""
        mask = attention_mask.to(torch.int64)
        start_ids = mask.argmax(dim=1)
        if check:
            left_padded = torch.arange(mask.shape[1])[None, :] >= start_ids[:, None]
            if not torch.equal(mask.bool(), left_padded) or not bool(mask.any(dim=1).all()):
                raise ValueError("attention_mask must mark left padding (zeros, then ones, on every line), "
                                 "as HF generate() wants for decoder-only models: tokenize with "
                                 "padding_side='left'")
        return start_ids.to(torch.int32)

    def forward(self, input_ids: torch.Tensor, cache_ids: torch.Tensor | None = None,
                start_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any):
        """Logits [batch, 1, vocab] of the last token (what greedy search and sampling read)."""
        if output_attentions or output_hidden_states:
            raise NotSupportedYet("output_attentions and output_hidden_states are not supported: the "
                                  "compiled model returns the logits of the last token only")
        if start_ids is None and attention_mask is not None:
            start_ids = self._start_ids(attention_mask, check=True)
        logits = self.model.forward(input_ids, cache_ids, start_ids)[:, None, :]
        if return_dict is False:
            return (logits,)
        return CausalLMOutputWithPast(logits=logits)
