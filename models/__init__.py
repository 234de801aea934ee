"""Models for zinfjax (installed as `zinfjax.models`): GPT, the Llama family, Hugging Face I/O."""

from .config import PRESETS, GPTConfig, get_config
from .data import CharTokenizer, TokenDataset, load_tokens
from .gpt import GPT, Block, lm_loss
from .llama import Llama, LlamaConfig
from .loss import chunked_cross_entropy
from . import hf, rope

__all__ = ["GPT", "Block", "GPTConfig", "Llama", "LlamaConfig", "hf", "rope", "PRESETS",
           "get_config", "lm_loss", "chunked_cross_entropy", "CharTokenizer", "TokenDataset",
           "load_tokens"]
