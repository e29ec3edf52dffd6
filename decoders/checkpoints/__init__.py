"""Checkpoint readers: Hugging Face directories (safetensors, sharded, .bin) and GGUF files,
both giving tensors by Hugging Face name; and the default model's fetcher."""
from decoders.checkpoints.base import Checkpoint, CheckpointError, MissingTensorError
from decoders.checkpoints.open import open_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "MissingTensorError", "open_checkpoint"]
