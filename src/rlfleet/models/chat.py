"""Token helpers shared by everything that scores or trains on chat-templated text."""

from __future__ import annotations

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
