"""Preference rows for DPO (NeMo RL's ``PreferenceDataset`` and ``BinaryPreferenceDataset``) and their tokens.

Two row formats, detected per row (a row with ``completions`` is the first):

* ``PreferenceDataset``: ``{"context": [messages], "completions": [{"rank": 0, "completion": [messages]},
  {"rank": 1, "completion": [messages]}]}``; the lower rank is preferred. As in NeMo RL's
  ``preference_preprocessor``, a row has exactly two completions and ties are refused.
* ``BinaryPreferenceDataset``: prompt / chosen / rejected columns (``PreferenceKeys``). A text prompt is one
  user message and a text reply one assistant message, as NeMo RL's ``format_data`` makes them; message
  lists are taken as they are, except that a reply starting with the whole context (as in
  ``HuggingFaceH4/ultrafeedback_binarized``) is cut to the messages after it.

A message is an object with text ``role`` and ``content``; other text fields are kept and null ones dropped
(Parquet gives every message of a column every field). A reply ends with an assistant message. Bad rows are
refused or, with ``on_bad_row="skip"``, dropped and counted per reason (``BAD_ROW_REASONS``).

Tokens: the prompt is the context through the chat template with the generation prompt. A reply of one
plain assistant message is its content and EOS (``response_target``, as SFT and GRPO train); a longer reply
is the chat template of context and reply past the prompt's tokens, up to its EOS, and is trained whole
(NeMo RL trains only its last message).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from transformers import PreTrainedTokenizerBase

from rlfleet.data.errors import DataError
from rlfleet.data.prompts import response_target
from rlfleet.data.response_dataset import MAX_BAD_ROW_SAMPLES, bad_row_error, json_type
from rlfleet.data.sources import RawRow, read_rows
from rlfleet.models.chat import encode_conversation, end_at_eos

Messages = tuple[dict[str, str], ...]

BAD_ROW_REASONS = (
    "invalid_json",
    "not_object",
    "missing_key",
    "wrong_type",
    "no_rank",
    "too_few_completions",
    "too_many_completions",
    "tied_ranks",
    "empty_prompt",
    "empty_reply",
    "reply_not_assistant",
    "identical_replies",
)
DROP_REASONS = ("prompt_too_long", "pair_too_long", "identical_tokens")


@dataclass(frozen=True)
class PreferenceKeys:
    """The columns of a ``BinaryPreferenceDataset`` row; the defaults are NeMo RL's."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


@dataclass(frozen=True)
class PreferenceExample:
    """One preference row, as messages.

    Attributes:
        context: The messages before the reply (system, user and earlier turns).
        chosen: The preferred reply's messages (usually one assistant message).
        rejected: The other reply's messages.
        where: Origin for messages: ``train.jsonl:12`` or ``train.parquet row 11``.
    """

    context: Messages
    chosen: Messages
    rejected: Messages
    where: str


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair in tokens, what DPO and reward models train on: a ``PreferenceExample``
    tokenised, or two of the model's own scored samples (``rlfleet.rollouts.pairs``).

    Attributes:
        prompt_ids: The chat-templated context with the generation prompt.
        chosen_ids: The preferred reply's tokens, ending with EOS.
        rejected_ids: The other reply's tokens, ending with EOS.
        where: Origin of the pair (``file:line``, or the sampled prompt), for messages.
        chosen_mask: 1 on the chosen reply's tokens the model produced, 0 on an episode's observation
            tokens (tool results); None: every token.
        rejected_mask: The same for the rejected reply.
    """

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    where: str
    chosen_mask: tuple[int, ...] | None = None
    rejected_mask: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BadRowReport:
    """Rows skipped as bad (``on_bad_row="skip"``): the count per reason of ``BAD_ROW_REASONS`` (all
    present) and the first few as ``"file:line: problem [reason]"``, for the log."""

    by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BAD_ROW_REASONS, 0))
    samples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


class _BadPreference(Exception):
    """A row that cannot become a ``PreferenceExample``: the reason (one of ``BAD_ROW_REASONS``) and why."""

    def __init__(self, reason: str, problem: str) -> None:
        super().__init__(problem)
        self.reason = reason


# ----------------------------------------------------------------------------------------------- rows


def _messages(value: object, what: str) -> Messages:
    """``value`` as messages: a list of objects with text ``role``, ``content`` and other fields."""
    if not isinstance(value, list | tuple):
        raise _BadPreference("wrong_type", f"{what} is a JSON {json_type(value)}, not a list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise _BadPreference("wrong_type", f"{what}[{i}] is a JSON {json_type(message)}, not an object")
        kept = {str(key): text for key, text in message.items() if text is not None}
        missing = [key for key in ("role", "content") if key not in kept]
        if missing:
            raise _BadPreference("missing_key", f"{what}[{i}] has no {missing}; a message needs both")
        not_text = sorted(key for key, text in kept.items() if not isinstance(text, str))
        if not_text:
            raise _BadPreference("wrong_type", f"{what}[{i}] field(s) {not_text} are not text")
        messages.append(kept)
    return tuple(messages)


def _rank(completion: object, i: int) -> tuple[float, Messages]:
    what = f"completions[{i}]"
    if not isinstance(completion, Mapping):
        raise _BadPreference("wrong_type", f"{what} is a JSON {json_type(completion)}, not an object")
    if "rank" not in completion:
        raise _BadPreference("no_rank", f"{what} has no 'rank'; give it one (the lower rank is preferred)")
    if "completion" not in completion:
        raise _BadPreference("missing_key", f"{what} has no 'completion' (its reply messages)")
    rank = completion["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int | float) or not math.isfinite(rank):
        raise _BadPreference("wrong_type", f"{what}.rank is {rank!r}, not a finite number")
    return rank, _messages(completion["completion"], f"{what}.completion")


def _ranked_row(row: Mapping[str, object]) -> tuple[Messages, Messages, Messages]:
    """Context, chosen and rejected of a ``PreferenceDataset`` row."""
    if "context" not in row:
        raise _BadPreference(
            "missing_key", f"'completions' without 'context' (keys: {sorted(map(str, row))})"
        )
    context = _messages(row["context"], "'context'")
    completions = row["completions"]
    if not isinstance(completions, list | tuple):
        raise _BadPreference("wrong_type", f"'completions' is a JSON {json_type(completions)}, not a list")
    if len(completions) < 2:
        raise _BadPreference("too_few_completions", f"{len(completions)} completion(s); DPO needs two")
    if len(completions) > 2:
        raise _BadPreference(
            "too_many_completions",
            f"{len(completions)} completions; DPO takes exactly two per row, as NeMo RL does: keep the "
            "pair to train on (e.g. the best and the worst rank)",
        )
    (rank_a, reply_a), (rank_b, reply_b) = (_rank(c, i) for i, c in enumerate(completions))
    if rank_a == rank_b:
        raise _BadPreference("tied_ranks", f"both completions have rank {rank_a!r}: no preference")
    return (context, reply_a, reply_b) if rank_a < rank_b else (context, reply_b, reply_a)


def _binary_row(row: Mapping[str, object], keys: PreferenceKeys) -> tuple[Messages, Messages, Messages]:
    """Context, chosen and rejected of a ``BinaryPreferenceDataset`` row: a text is one user (prompt) or
    assistant (reply) message, a list is messages."""
    columns = (keys.prompt_key, keys.chosen_key, keys.rejected_key)
    missing = [key for key in columns if key not in row]
    if missing:
        raise _BadPreference(
            "missing_key",
            f"missing key(s) {missing} (keys present: {sorted(map(str, row))}); set data.prompt_key / "
            "data.chosen_key / data.rejected_key to the prompt and reply columns, or write PreferenceDataset "
            "rows ('context' and 'completions')",
        )

    def messages(key: str, role: str) -> Messages:
        value = row[key]
        return ({"role": role, "content": value},) if isinstance(value, str) else _messages(value, repr(key))

    return messages(columns[0], "user"), messages(columns[1], "assistant"), messages(columns[2], "assistant")


def _reply(reply: Messages, context: Messages, what: str) -> Messages:
    """``reply`` without a leading copy of ``context``, checked to end with a non-empty assistant message."""
    if context and reply[: len(context)] == context:
        reply = reply[len(context) :]
    if not reply or not reply[-1]["content"].strip():
        raise _BadPreference("empty_reply", f"the {what} reply is empty")
    if (role := reply[-1]["role"]) != "assistant":
        raise _BadPreference(
            "reply_not_assistant", f"the {what} reply ends with a {role!r} message, not an assistant one"
        )
    return reply


def _parse_row(value: object, where: str, keys: PreferenceKeys) -> PreferenceExample:
    """The ``PreferenceExample`` of one row of either format; ``_BadPreference`` if it is unusable."""
    if not isinstance(value, Mapping):
        raise _BadPreference("not_object", f"the row is a JSON {json_type(value)}, not an object")
    if "completions" in value:
        context, chosen, rejected = _ranked_row(value)
    else:
        context, chosen, rejected = _binary_row(value, keys)
    if not any(message["content"].strip() for message in context):
        raise _BadPreference("empty_prompt", "the prompt (context) is empty")
    chosen, rejected = _reply(chosen, context, "chosen"), _reply(rejected, context, "rejected")
    if chosen == rejected:
        raise _BadPreference("identical_replies", "the chosen and rejected replies are identical")
    return PreferenceExample(context=context, chosen=chosen, rejected=rejected, where=where)


def _collect(
    rows: Iterable[RawRow], keys: PreferenceKeys, on_bad_row: Literal["error", "skip"], name: str
) -> tuple[list[PreferenceExample], BadRowReport]:
    examples: list[PreferenceExample] = []
    report = BadRowReport()
    for raw in rows:
        try:
            if raw.problem is not None:
                raise _BadPreference("invalid_json", raw.problem)
            examples.append(_parse_row(raw.value, raw.where, keys))
        except _BadPreference as bad:
            message = f"{raw.where}: {bad} [{bad.reason}]"
            if on_bad_row == "error":
                raise bad_row_error(name, message) from None
            report.by_reason[bad.reason] += 1
            if len(report.samples) < MAX_BAD_ROW_SAMPLES:
                report.samples.append(message)
    return examples, report


def preference_examples(
    rows: Iterable[object],
    *,
    keys: PreferenceKeys,
    on_bad_row: Literal["error", "skip"],
    name: str,
    label: str = "rows",
) -> tuple[list[PreferenceExample], BadRowReport]:
    """Rows in memory as examples, as ``load_preference_split`` reads a file (row ``i`` is ``{label} row {i}``
    in messages); for tests and callers that hold rows, it reads and writes no file."""
    raw = (RawRow(f"{label} row {i}", value) for i, value in enumerate(rows))
    return _collect(raw, keys, on_bad_row, name)


def load_preference_split(
    path: str,
    *,
    split: str,
    subset: str | None,
    keys: PreferenceKeys,
    on_bad_row: Literal["error", "skip"],
    name: str,
) -> tuple[list[PreferenceExample], BadRowReport]:
    """Reads and validates every preference row of a local file or hub dataset (see ``read_rows``).

    Args:
        path: Hub id, local directory, or ``.jsonl`` / ``.json`` / ``.parquet`` file.
        split: Hub split (ignored for local files).
        subset: Hub configuration name, or None.
        keys: The columns of ``BinaryPreferenceDataset`` rows.
        on_bad_row: ``"error"`` stops at the first bad row; ``"skip"`` drops and counts it.
        name: ``train`` or ``val``, for messages.

    Raises:
        DataError: A bad row with ``on_bad_row="error"`` (naming ``file:line`` or ``row I``, the problem and
            the fix), an unreadable source, or no usable row.
    """
    examples, report = _collect(read_rows(path, split=split, subset=subset), keys, on_bad_row, name)
    if not examples:
        raise DataError(
            f"{name} preference data {path!r} has no usable rows ({report.total} bad rows skipped: "
            f"{ {k: n for k, n in report.by_reason.items() if n} }); check the file and {keys}"
        )
    return examples, report


# --------------------------------------------------------------------------------------------- tokens


def _template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt
    )
    assert isinstance(text, str)  # tokenize=False: the rendered text
    return encode_conversation(tokenizer, text)


def _reply_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Messages,
    prompt_ids: Sequence[int],
    reply: Messages,
    where: str,
) -> list[int]:
    """The tokens of ``reply`` after ``prompt`` (whose template tokens are ``prompt_ids``), ending with EOS;
    DataError if the template renders ``prompt`` differently once ``reply`` follows it."""
    if len(reply) == 1 and set(reply[0]) == {"role", "content"}:
        return response_target(tokenizer, reply[0]["content"])
    full = _template_ids(tokenizer, (*prompt, *reply), generation_prompt=False)
    if full[: len(prompt_ids)] != list(prompt_ids):
        raise DataError(
            f"{where}: the chat template's tokens for the context are not a prefix of its tokens for "
            "context and reply (it renders earlier turns differently, or a token spans the boundary), so "
            "the reply cannot be cut out; write each reply as one assistant message, or use a chat template "
            "that renders earlier turns unchanged"
        )
    return end_at_eos(tokenizer, full[len(prompt_ids) :])


def _prompt_messages(context: Messages, system_prompt: str | None) -> Messages:
    if system_prompt and not any(message["role"] == "system" for message in context):
        return ({"role": "system", "content": system_prompt}, *context)
    return context


def tokenize_pairs(
    examples: Iterable[PreferenceExample],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_total_length: int,
    system_prompt: str | None = None,
) -> tuple[list[PreferencePair], dict[str, int]]:
    """Tokenises ``examples``; drops pairs that do not fit ``max_total_length`` or tokenise the same.

    Args:
        examples: Parsed preference rows.
        tokenizer: Tokenizer with a chat template and an EOS token.
        max_total_length: Longest prompt plus longer reply kept.
        system_prompt: System message put first when a context has none, or None.

    Returns:
        The pairs kept and the pairs dropped per reason of ``DROP_REASONS`` (each pair under the first that
        applies: a prompt with no room for a reply, identical reply tokens, prompt and longer reply too long).

    Raises:
        ValueError: ``max_total_length`` is not positive, or the tokenizer has no chat template or EOS.
        DataError: A multi-message reply that cannot be cut after its prompt (see ``_reply_ids``).
    """
    if max_total_length < 1:
        raise ValueError(f"max_total_length={max_total_length} must be at least 1")
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; use an instruct/chat model or set one")
    pairs: list[PreferencePair] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for ex in examples:
        pair = _pair_or_drop_reason(tokenizer, ex, max_total_length, system_prompt)
        if isinstance(pair, str):
            dropped[pair] += 1
        else:
            pairs.append(pair)
    return pairs, dropped


def _pair_or_drop_reason(
    tokenizer: PreTrainedTokenizerBase, ex: PreferenceExample, max_length: int, system_prompt: str | None
) -> PreferencePair | str:
    """The pair of ``ex``, or the reason it is dropped (one of ``DROP_REASONS``)."""
    prompt = _prompt_messages(ex.context, system_prompt)
    prompt_ids = _template_ids(tokenizer, prompt, generation_prompt=True)
    if len(prompt_ids) >= max_length:
        return "prompt_too_long"
    chosen = _reply_ids(tokenizer, prompt, prompt_ids, ex.chosen, ex.where)
    rejected = _reply_ids(tokenizer, prompt, prompt_ids, ex.rejected, ex.where)
    if chosen == rejected:
        return "identical_tokens"
    if len(prompt_ids) + max(len(chosen), len(rejected)) > max_length:
        return "pair_too_long"
    return PreferencePair(tuple(prompt_ids), tuple(chosen), tuple(rejected), ex.where)
