"""The pieces a decoder is built from. Each declares its parameters once (`Param`: name,
shape, tensor-parallel axis, checkpoint source) and writes its part of a program."""
from decoders.blocks.attention import Alibi, Attention, Rotary
from decoders.blocks.embedding import Embedding, Head
from decoders.blocks.layer import Decoder, DecoderLayer
from decoders.blocks.mlp import MLP
from decoders.blocks.moe import MoE
from decoders.blocks.norm import Norm
from decoders.blocks.params import Kind, Param, Shard, Source

__all__ = ["Alibi", "Attention", "Decoder", "DecoderLayer", "Embedding", "Head", "Kind", "MLP", "MoE", "Norm",
           "Param", "Rotary", "Shard", "Source"]
