"""Loading a policy model and its tokenizer from a Hugging Face hub id or a local directory."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Loads a tokenizer and makes sure it can pad (pad = eos when the model defines no pad token)."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str, precision: str) -> PreTrainedModel:
    """Loads a causal LM in ``precision`` ("float32", "bfloat16" or "float16")."""
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[precision])
    model.config.use_cache = False
    return model
