"""A tiny Llama-style model and a tokenizer trained on the fly, saved in Hugging Face format.

The result is a plain model directory, so ``policy.model_name`` points at it like at any hub model.
Nothing is downloaded: the tokenizer is a byte-level BPE trained with ``tokenizers`` on a text corpus
(digits split one per token, which arithmetic needs), and the weights are initialised from a seed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START = "<|pad|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny model (Llama layout)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    vocab_size: int = 512
    tie_word_embeddings: bool = True


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on ``corpus`` and wraps it with a chat template and special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    wrapped.add_special_tokens({"additional_special_tokens": [IM_START]})
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama-style causal LM sized by ``spec`` for ``tokenizer``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def create_tiny_model(out_dir: str | Path, corpus: Iterable[str], spec: TinyModelSpec, seed: int) -> Path:
    """Trains a tokenizer on ``corpus``, builds the model, and saves both to ``out_dir`` (HF format)."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus, spec.vocab_size)
    model = build_tiny_model(spec, tokenizer, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
