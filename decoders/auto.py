"""NeuronAutoModelForCausalLM: the *ForSampling class a checkpoint needs, picked by its model_type.

    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=2, n_positions=512)

`path` is what from_pretrained() takes: an HF directory (config.json's `model_type`) or a GGUF
file (its architecture, mapped to a model_type by the checkpoint reader).
"""
from __future__ import annotations

import os
from typing import Any

from decoders.checkpoints import open_checkpoint
from decoders.model import DecoderForSampling


class NeuronAutoModelForCausalLM:
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any,
                        **kwargs: Any) -> DecoderForSampling:
        """from_pretrained() of the family registered for the checkpoint's model_type."""
        from decoders import families

        with open_checkpoint(pretrained_model_name_or_path) as checkpoint:
            model_type = checkpoint.config.get("model_type")
        try:
            model_class = families.sampling_class(model_type)
        except ValueError as error:
            raise ValueError(f"{pretrained_model_name_or_path}: {error}") from None
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
