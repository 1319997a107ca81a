"""Turning task rows into model prompts through the tokenizer's chat template.

A prompt template (``data.prompt_file``, NeMo RL style) wraps the question before the chat template is
applied: the file's text with the question in place of ``{}`` (or ``{question}``); it is applied with
``str.format``, so literal braces are written ``{{`` and ``}}`` (``\\boxed{{}}``). The system message comes
from ``data.system_prompt`` or ``data.system_prompt_file``. Files are read verbatim (no stripping), as
NeMo RL does, so prompt text matches it byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from string import Formatter
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlfleet.config.schema import DataConfig
from rlfleet.data.errors import DataError
from rlfleet.data.types import Example, Prompt
from rlfleet.environments.interface import Message
from rlfleet.errors import UserError
from rlfleet.models.chat import encode_conversations

_PLACEHOLDERS = ("", "0", "question")


def _read_prompt_file(key: str, path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(
            f"data.{key}={path!r} does not exist (resolved to {file.resolve()}); fix the path (relative "
            f"paths start from the working directory {Path.cwd()}) or unset data.{key}"
        )
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"data.{key}={path!r} cannot be read as UTF-8 text ({exc}); fix the file") from exc


def resolve_system_prompt(data: DataConfig) -> str | None:
    """The system message: ``data.system_prompt``, else the text of ``data.system_prompt_file``, else None.

    An empty file gives None (no system message), as an empty ``system_prompt`` does.

    Raises:
        DataError: ``system_prompt_file`` is missing or unreadable.
    """
    if data.system_prompt_file is None:
        return data.system_prompt or None
    return _read_prompt_file("system_prompt_file", data.system_prompt_file) or None


def check_prompt_template(template: str, source: str = "prompt template") -> None:
    """Checks that ``template`` has a question placeholder and formats with the question alone.

    Raises:
        DataError: No placeholder, an unknown field such as ``{answer}``, or unescaped literal braces.
    """
    fix = (
        "put '{}' (or '{question}') where the question goes and write literal braces doubled, "
        "e.g. '\\boxed{{}}'"
    )
    try:
        fields = [name for _, name, _, _ in Formatter().parse(template) if name is not None]
        unknown = sorted({name for name in fields if name not in _PLACEHOLDERS})
        if not unknown:
            template.format("", question="")
    except (ValueError, IndexError, KeyError) as exc:
        raise DataError(f"{source} cannot be formatted with the question ({exc!r}); {fix}") from exc
    if unknown:
        raise DataError(f"{source} has unknown fields {unknown}; only the question can be filled in: {fix}")
    if not fields:
        raise DataError(f"{source} has no placeholder for the question; {fix}")


def load_prompt_template(data: DataConfig) -> str | None:
    """The text of ``data.prompt_file`` (checked), or None when unset.

    Raises:
        DataError: The file is missing or unreadable, or its template is invalid (see
            ``check_prompt_template``).
    """
    if data.prompt_file is None:
        return None
    template = _read_prompt_file("prompt_file", data.prompt_file)
    check_prompt_template(template, f"data.prompt_file={data.prompt_file!r}")
    return template


def apply_prompt_template(template: str | None, question: str) -> str:
    """``question`` placed into ``template`` (``{}``, ``{0}`` or ``{question}``); unchanged without one."""
    return question if template is None else template.format(question, question=question)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    system_prompt: str | None,
    prompt_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Applies the prompt template, then the chat template (with the generation prompt and ``tools``' schemas,
    which templates that support tools render), to one question."""
    if tokenizer.chat_template is None:
        raise ValueError(
            "the tokenizer has no chat template; use an instruct/chat model or a tokenizer that defines one"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": apply_prompt_template(prompt_template, question)})
    schemas: list[dict[Any, Any] | Callable[..., Any]] | None = [dict(t) for t in tools] if tools else None
    text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)  # tokenize=False: the rendered text
    return text


def build_prompts(
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    *,
    system_prompt: str | None,
    max_prompt_tokens: int | None,
    prompt_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[Prompt], int]:
    """Renders and tokenises ``examples``; drops prompts longer than ``max_prompt_tokens``.

    Args:
        tokenizer: Tokenizer with a chat template.
        examples: The task rows.
        system_prompt: System message, or None (see ``resolve_system_prompt``).
        max_prompt_tokens: Longest prompt kept, or None for no limit.
        prompt_template: Template wrapping each question, or None (see ``load_prompt_template``).

    Returns:
        The kept prompts and the number dropped for length.
    """
    if prompt_template is not None:
        check_prompt_template(prompt_template)
    texts = [render_prompt(tokenizer, ex.question, system_prompt, prompt_template, tools) for ex in examples]
    prompts: list[Prompt] = []
    dropped = 0
    for ex, text, ids in zip(examples, texts, encode_conversations(tokenizer, texts), strict=True):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(example=ex, text=text, token_ids=tuple(ids)))
    return prompts, dropped


def response_target(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Token ids the model should produce for ``answer``: the answer followed by the EOS token."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set one so responses can end")
    return [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


CONTEXT_SPANS = "context_spans"
"""``Example.extra`` key: parts of the answer that are context, not targets (an episode's tool messages)."""


def response_target_and_mask(
    tokenizer: PreTrainedTokenizerBase, answer: str, context: Sequence[str] = ()
) -> tuple[list[int], list[int] | None]:
    """:func:`response_target` and, when ``context`` names parts of ``answer`` (an episode's observations,
    each found in order), a mask that is 0 on the tokens starting inside them: SFT on an episode learns the
    model's turns only, as GRPO trains them. None when there is no context."""
    if not context:
        return response_target(tokenizer, answer), None
    spans, start = [], 0
    for text in context:
        at = answer.find(text, start)
        if at < 0:
            raise ValueError(f"context span {text[:40]!r} is not in the answer after position {start}")
        spans.append((at, at + len(text)))
        start = at + len(text)
    encoded = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0 if any(a <= first < b for a, b in spans) else 1 for first, _ in encoded["offset_mapping"]]
    return [*encoded["input_ids"], tokenizer.eos_token_id], [*mask, 1]


_MARK = "\x00rlfleet-turn\x00"


class ObservationTemplate:
    """Renders an environment's message as the tokens that follow a model turn, with the chat template.

    The text is what the template puts after an assistant message's content when the observation follows
    it, generation prompt included (ChatML: ``<|im_end|>\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>
    assistant\\n``); when the turn already ended with EOS, the EOS text it starts with is dropped.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        self.eos_text = eos if isinstance(eos, str) else ""

    def text(self, observation: Message, ended_with_eos: bool) -> str:
        return self.text_of([observation], ended_with_eos)

    def text_of(self, observations: Sequence[Message], ended_with_eos: bool) -> str:
        """The text that follows a model turn when ``observations`` (one or more messages) come after it."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}, *observations]
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            roles = ", ".join(repr(o["role"]) for o in observations)
            raise UserError(
                f"the chat template cannot render messages with role {roles} after an assistant turn "
                f"({exc!r}); use roles the template knows"
            ) from exc
        assert isinstance(rendered, str)
        if _MARK not in rendered:
            raise UserError(
                "the chat template drops assistant messages; multi-turn episodes need one that keeps them"
            )
        after = rendered.split(_MARK, 1)[1]
        if ended_with_eos and self.eos_text and after.startswith(self.eos_text):
            after = after[len(self.eos_text) :]
        return after

    def ids(self, observation: Message, ended_with_eos: bool) -> list[int]:
        return self.ids_of([observation], ended_with_eos)

    def ids_of(self, observations: Sequence[Message], ended_with_eos: bool) -> list[int]:
        text = self.text_of(observations, ended_with_eos)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
