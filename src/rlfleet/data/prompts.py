"""Turning task rows into model prompts through the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rlfleet.data.types import Example, Prompt


def render_prompt(tokenizer: PreTrainedTokenizerBase, question: str, system_prompt: str | None) -> str:
    """Applies the chat template (with the generation prompt) to one question."""
    if tokenizer.chat_template is None:
        raise ValueError(
            "the tokenizer has no chat template; use an instruct/chat model or a tokenizer that defines one"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_prompts(
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    *,
    system_prompt: str | None,
    max_prompt_tokens: int | None,
) -> tuple[list[Prompt], int]:
    """Renders and tokenises ``examples``; drops prompts longer than ``max_prompt_tokens``.

    Returns:
        The kept prompts and the number dropped for length.
    """
    prompts: list[Prompt] = []
    dropped = 0
    for ex in examples:
        text = render_prompt(tokenizer, ex.question, system_prompt)
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(example=ex, text=text, token_ids=ids))
    return prompts, dropped


def response_target(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Token ids the model should produce for ``answer``: the answer followed by the EOS token."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set one so responses can end")
    return [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
