"""Token helpers shared by everything that scores or trains on chat-templated text."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


def end_at_eos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """``ids`` cut after their last EOS when only whitespace follows (a chat template's ``<|im_end|>\\n``),
    else with EOS added: a reply ends at its EOS, where training reads a reward model's score and where the
    ``reward_model`` environment must read it too."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        last = len(ids) - 1 - ids[::-1].index(eos)
        if not str(tokenizer.decode(ids[last + 1 :])).strip():
            return ids[: last + 1]
    return [*ids, eos]


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's own encoding starts a text with BOS: how the model was trained to see a
    document begin (Gemma's and Llama's do; SmolLM2's and Qwen's add nothing)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("x")["input_ids"]
    return bool(ids) and ids[0] == bos


def encode_conversation(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A whole rendered conversation (a prompt, a scored dialogue) as token ids, starting with BOS exactly
    when the tokenizer starts a text with one: a chat template that writes ``{{ bos_token }}`` already put
    it in ``text``; a template that does not (a passthrough or a plain one) gets it here, so a model trained
    with BOS never sees a prompt without it, and one trained without never gets one. The text itself is
    encoded without special tokens (the template wrote the ones it wants)."""
    return encode_conversations(tokenizer, [text])[0]


def encode_conversations(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """:func:`encode_conversation` of each text, in one call to the tokenizer (a dataset's prompts)."""
    if not texts:
        return []
    batch = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    return [[bos, *ids] if bos is not None and (not ids or ids[0] != bos) else list(ids) for ids in batch]
