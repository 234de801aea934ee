"""GPT models for zinfjax (installed as `zinfjax.models`)."""

from .config import PRESETS, GPTConfig, get_config
from .data import CharTokenizer, TokenDataset, load_tokens
from .gpt import GPT, Block, lm_loss

__all__ = ["GPT", "Block", "GPTConfig", "PRESETS", "get_config", "lm_loss",
           "CharTokenizer", "TokenDataset", "load_tokens"]
