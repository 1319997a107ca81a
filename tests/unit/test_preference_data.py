"""Preference data for DPO: NeMo RL's two row formats from files and the hub, bad rows, and token pairs."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.data.errors import DataError
from rlfleet.data.preferences import (
    BAD_ROW_REASONS,
    DROP_REASONS,
    PreferenceExample,
    PreferenceKeys,
    load_preference_split,
    preference_examples,
    tokenize_pairs,
)
from rlfleet.models.tiny import train_tokenizer
from tests.unit.test_response_dataset import FakeHub, write_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 2+3?"}
TURNS = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
NAME = {"role": "user", "content": "Name?"}


def reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


RANKED = [  # NeMo RL's PreferenceDataset rows; the first lists the preferred completion second
    {
        "context": [USER],
        "completions": [{"rank": 1, "completion": reply("6")}, {"rank": 0, "completion": reply("5")}],
    },
    {
        "context": [SYSTEM, *TURNS, NAME],
        "completions": [{"rank": 0, "completion": reply("Fleet")}, {"rank": 2, "completion": reply("No.")}],
    },
]
BINARY = [  # NeMo RL's BinaryPreferenceDataset rows: text or message lists
    {"prompt": USER["content"], "chosen": "5", "rejected": "6"},
    {"prompt": [SYSTEM, *TURNS, NAME], "chosen": reply("Fleet"), "rejected": reply("No.")},
]
BINARY_LISTS = [  # the same as message lists only (a Parquet column has one type)
    {"prompt": [USER], "chosen": reply("5"), "rejected": reply("6")},
    BINARY[1],
]
EXPECTED = [(USER,), (SYSTEM, *TURNS, NAME)]
EXPECTED_REPLIES = [(reply("5"), reply("6")), (reply("Fleet"), reply("No."))]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(["user assistant system tool hello What is Name Fleet"], 300)


def load(path: Path | str, on_bad_row: Any = "error", **kw: Any) -> tuple[list[PreferenceExample], Any]:
    kw.setdefault("keys", PreferenceKeys())
    return load_preference_split(
        str(path), split="train", subset=None, on_bad_row=on_bad_row, name="train", **kw
    )


def check_expected(examples: list[PreferenceExample]) -> None:
    assert [ex.context for ex in examples] == EXPECTED
    assert [(list(ex.chosen), list(ex.rejected)) for ex in examples] == EXPECTED_REPLIES


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as ``.jsonl``, an indented ``.json`` array or ``.parquet``, by the suffix of ``path``."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    else:
        write_jsonl(path, rows)
    return path


def expected_where(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        return [f"{path} row 0", f"{path} row 1"]
    if path.suffix == ".json":  # the line where each object of the array starts
        starts = [n for n, line in enumerate(path.read_text().splitlines(), 1) if line == "  {"]
        return [f"{path}:{n}" for n in starts]
    return [f"{path}:1", f"{path}:2"]


# ----------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize("rows", ["ranked", "binary"])
def test_both_formats_from_local_files(tmp_path: Path, suffix: str, rows: str) -> None:
    data = {"ranked": RANKED, "binary": BINARY_LISTS if suffix == ".parquet" else BINARY}[rows]
    path = write(tmp_path / f"prefs{suffix}", data)
    examples, report = load(path)
    check_expected(examples)
    assert [ex.where for ex in examples] == expected_where(path)
    assert report.total == 0 and report.by_reason == dict.fromkeys(BAD_ROW_REASONS, 0)


@pytest.mark.parametrize("rows", [RANKED, BINARY_LISTS])
def test_hub_rows_go_through_load_dataset(
    monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]
) -> None:
    import datasets

    hub = FakeHub(rows)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    examples, _ = load_preference_split(
        "org/prefs", split="test", subset="main", keys=PreferenceKeys(), on_bad_row="error", name="val"
    )
    assert hub.calls == [("org/prefs", "main", "test")]
    check_expected(examples)
    assert examples[1].where == "org/prefs (subset='main', split='test') row 1"


def test_hub_bad_row_names_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(
        datasets, "load_dataset", FakeHub([BINARY_LISTS[0], {**BINARY_LISTS[0], "chosen": []}])
    )
    with pytest.raises(DataError, match=r"bad train row at org/p \(subset=None, split='train'\) row 1: "):
        load("org/p")


def test_format_is_detected_per_row_and_keys_are_configurable(tmp_path: Path) -> None:
    renamed = {"question": BINARY[0]["prompt"], "good": "5", "bad": "6"}
    path = write_jsonl(tmp_path / "mixed.jsonl", [renamed, RANKED[1]])
    examples, _ = load(
        path, keys=PreferenceKeys(prompt_key="question", chosen_key="good", rejected_key="bad")
    )
    check_expected(examples)
    with pytest.raises(
        DataError, match=r"mixed.jsonl:1: missing key\(s\) \['prompt', 'chosen', 'rejected'\]"
    ):
        load(path)


def test_reply_repeating_the_context_is_cut_to_what_follows(tmp_path: Path) -> None:
    """ultrafeedback_binarized stores each reply as the whole conversation, the prompt as text."""
    row = {"prompt": USER["content"], "chosen": [USER, *reply("5")], "rejected": [USER, *reply("6")]}
    (example,), _ = load(write_jsonl(tmp_path / "uf.jsonl", [row]))
    assert (example.context, example.chosen, example.rejected) == (
        (USER,),
        tuple(reply("5")),
        tuple(reply("6")),
    )


def test_null_message_fields_are_dropped_and_text_ones_kept(tmp_path: Path) -> None:
    named = {"role": "assistant", "content": "5", "name": "bot"}
    rows = [{"prompt": [USER], "chosen": [named], "rejected": reply("6")}, BINARY_LISTS[0]]
    path = write(tmp_path / "named.parquet", rows)
    assert pq.read_table(path).to_pylist()[1]["chosen"] == [
        {"role": "assistant", "content": "5", "name": None}
    ]
    examples, _ = load(path)
    assert [ex.chosen for ex in examples] == [(named,), tuple(reply("5"))]


def test_rows_in_memory(tmp_path: Path) -> None:
    examples, report = preference_examples(
        [RANKED[0], 7, BINARY[1]], keys=PreferenceKeys(), on_bad_row="skip", name="train", label="inline"
    )
    check_expected(examples)
    assert [ex.where for ex in examples] == ["inline row 0", "inline row 2"]
    assert report.by_reason["not_object"] == 1 and report.samples == [
        "inline row 1: the row is a JSON number, not an object [not_object]"
    ]


# ---------------------------------------------------------------------------------------------- bad rows


def ranked(*completions: Any, context: Any = (USER,)) -> str:
    return json.dumps({"context": list(context), "completions": list(completions)})


def binary(prompt: Any = "Q?", chosen: Any = "5", rejected: Any = "6") -> str:
    return json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected})


C0, C1 = {"rank": 0, "completion": reply("5")}, {"rank": 1, "completion": reply("6")}
# (reason, bad row, words its message must contain)
BAD_ROWS = [
    ("invalid_json", '{"prompt": "Q?", ', "invalid JSON"),
    ("not_object", '["Q?", "5", "6"]', "the row is a JSON array, not an object"),
    (
        "missing_key",
        '{"prompt": "Q?", "chosen": "5"}',
        "missing key(s) ['rejected'] (keys present: ['chosen', 'prompt'])",
    ),
    ("missing_key", json.dumps({"completions": [C0, C1]}), "'completions' without 'context'"),
    ("missing_key", ranked(C0, {"rank": 1}), "completions[1] has no 'completion'"),
    ("missing_key", binary(chosen=[{"role": "assistant"}]), "'chosen'[0] has no ['content']"),
    ("wrong_type", binary(prompt=7), "'prompt' is a JSON number, not a list of messages"),
    ("wrong_type", binary(chosen=["5"]), "'chosen'[0] is a JSON string, not an object"),
    (
        "wrong_type",
        binary(rejected=[{"role": "assistant", "content": 6}]),
        "field(s) ['content'] are not text",
    ),
    (
        "wrong_type",
        ranked(C0, {**C1, "rank": "second"}),
        "completions[1].rank is 'second', not a finite number",
    ),
    (
        "wrong_type",
        json.dumps({"context": [USER], "completions": {"a": C0}}),
        "'completions' is a JSON object",
    ),
    ("no_rank", ranked(C0, {"completion": reply("6")}), "completions[1] has no 'rank'"),
    ("too_few_completions", ranked(C0), "1 completion(s); DPO needs two"),
    ("too_many_completions", ranked(C0, C1, {**C1, "rank": 2}), "3 completions; DPO takes exactly two"),
    ("tied_ranks", ranked(C0, {**C1, "rank": 0}), "both completions have rank 0"),
    ("empty_prompt", binary(prompt="  "), "the prompt (context) is empty"),
    ("empty_prompt", ranked(C0, C1, context=()), "the prompt (context) is empty"),
    ("empty_reply", binary(chosen=""), "the chosen reply is empty"),
    ("empty_reply", ranked(C0, {"rank": 1, "completion": []}), "the rejected reply is empty"),
    ("empty_reply", binary(prompt=[USER], rejected=[USER]), "the rejected reply is empty"),
    (
        "reply_not_assistant",
        binary(rejected=[{"role": "user", "content": "6"}]),
        "ends with a 'user' message",
    ),
    ("identical_replies", binary(rejected="5"), "the chosen and rejected replies are identical"),
]


def test_every_reason_has_a_bad_row() -> None:
    assert {reason for reason, _, _ in BAD_ROWS} == set(BAD_ROW_REASONS)


@pytest.mark.parametrize(
    ("reason", "row", "words"), BAD_ROWS, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_ROWS)]
)
def test_bad_row_in_both_modes(tmp_path: Path, reason: str, row: str, words: str) -> None:
    path = write_jsonl(tmp_path / "prefs.jsonl", [BINARY[0], row, json.dumps(BINARY[1])])
    expected = (
        rf"bad train row at {re.escape(str(path))}:2: .*{re.escape(words)}.*\[{reason}\]; fix or remove"
    )
    with pytest.raises(DataError, match=expected + r".*data\.on_bad_row=skip"):
        load(path)
    examples, report = load(path, on_bad_row="skip")
    check_expected(examples)
    assert report.by_reason == {**dict.fromkeys(BAD_ROW_REASONS, 0), reason: 1} and report.total == 1
    assert len(report.samples) == 1 and re.match(
        f"{re.escape(str(path))}:2: .*{re.escape(words)}", report.samples[0]
    )


def test_no_usable_row_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ["[1]", ranked(C0, {**C1, "rank": 0})])
    with pytest.raises(
        DataError, match=r"no usable rows \(2 bad rows skipped: \{'not_object': 1, 'tied_ranks': 1\}"
    ):
        load(path, on_bad_row="skip")


# ------------------------------------------------------------------------------------------------ tokens


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def example(context: Any, chosen: Any, rejected: Any) -> PreferenceExample:
    return PreferenceExample(tuple(context), tuple(chosen), tuple(rejected), where="t.jsonl:4")


def test_prompt_has_the_generation_prompt_and_replies_end_with_eos(tmp_path: Path, tokenizer: Any) -> None:
    examples, _ = load(write_jsonl(tmp_path / "p.jsonl", RANKED))
    pairs, dropped = tokenize_pairs(examples, tokenizer, max_total_length=1000)
    assert dropped == dict.fromkeys(DROP_REASONS, 0)
    first = pairs[0]
    assert (
        tokenizer.decode(first.prompt_ids)
        == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(first.chosen_ids) == [*ids(tokenizer, "5"), tokenizer.eos_token_id]
    assert list(first.rejected_ids) == [*ids(tokenizer, "6"), tokenizer.eos_token_id]
    assert first.where == examples[0].where
    text = tokenizer.apply_chat_template(RANKED[1]["context"], tokenize=False, add_generation_prompt=True)
    assert list(pairs[1].prompt_ids) == ids(tokenizer, text)
    assert tokenizer.decode(pairs[1].chosen_ids) == "Fleet<|im_end|>"


def test_system_prompt_only_where_the_context_has_none(tokenizer: Any) -> None:
    plain, with_system = (
        example([USER], reply("5"), reply("6")),
        example([SYSTEM, USER], reply("5"), reply("6")),
    )
    pairs, _ = tokenize_pairs(
        [plain, with_system], tokenizer, max_total_length=1000, system_prompt="Be kind."
    )
    first, second = (tokenizer.decode(p.prompt_ids) for p in pairs)
    assert first.startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nWhat is 2+3?")
    assert (
        second.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
        and "kind" not in second
    )


def test_multi_message_reply_is_the_template_after_the_prompt(tokenizer: Any) -> None:
    chosen = [
        {"role": "assistant", "content": "Let me add."},
        {"role": "tool", "content": "5"},
        *reply("It is 5."),
    ]
    (pair,), _ = tokenize_pairs([example([USER], chosen, reply("6"))], tokenizer, max_total_length=1000)
    assert tokenizer.decode(pair.chosen_ids) == (
        "Let me add.<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\nIt is 5.<|im_end|>"
    )
    full = ids(tokenizer, tokenizer.apply_chat_template([USER, *chosen], tokenize=False))
    together = [*pair.prompt_ids, *pair.chosen_ids]
    assert full[: len(together)] == together and tokenizer.decode(full[len(together) :]) == "\n"


def test_reply_without_eos_in_its_template_gets_one(tokenizer: Any) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    chosen = [*reply("Let me add."), *reply("It is 5.")]
    (pair,), _ = tokenize_pairs([example([USER], chosen, reply("6"))], plain, max_total_length=1000)
    assert pair.chosen_ids[-1] == plain.eos_token_id
    assert plain.decode(pair.chosen_ids) == "Let me add.\nassistant:\nIt is 5.\n<|im_end|>"


def test_one_message_with_more_fields_goes_through_the_template(tokenizer: Any) -> None:
    named = copy.deepcopy(tokenizer)
    named.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':\n' }}{% if m['name'] is defined %}[{{ m['name'] }}] "
        "{% endif %}{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    bot = [{"role": "assistant", "content": "5", "name": "bot"}]
    (pair,), _ = tokenize_pairs([example([USER], bot, reply("6"))], named, max_total_length=1000)
    assert named.decode(pair.chosen_ids) == "[bot] 5<|im_end|>"
    assert named.decode(pair.rejected_ids) == "6<|im_end|>"


def test_template_that_rewrites_the_context_is_refused(tokenizer: Any) -> None:
    marked = copy.deepcopy(tokenizer)  # marks the last message, so the prompt changes once a reply follows
    marked.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant\n' }}{% endif %}"
    )
    two_messages = [*reply("Let me add."), *reply("It is 5.")]
    with pytest.raises(
        DataError, match=r"t\.jsonl:4: .*not a prefix.*write each reply as one assistant message"
    ):
        tokenize_pairs([example([USER], two_messages, reply("6"))], marked, max_total_length=1000)


def test_length_budget_and_identical_tokens_drop_pairs(tokenizer: Any) -> None:
    long_reply = example([USER], reply("It is 5, of course."), reply("6"))
    (pair,), _ = tokenize_pairs([long_reply], tokenizer, max_total_length=1000)
    fits = len(pair.prompt_ids) + len(pair.chosen_ids)
    assert len(pair.chosen_ids) > len(pair.rejected_ids)  # the longer reply sets the length
    # the same text, one plain message and one with an extra field (rendered by the template): same tokens
    same = example([USER], reply("5"), [{"role": "assistant", "content": "5", "name": "bot"}])
    for budget, kept, expected in [
        (fits, 1, {}),
        (fits - 1, 0, {"pair_too_long": 1}),
        (len(pair.prompt_ids) + 1, 0, {"pair_too_long": 1}),
        (len(pair.prompt_ids), 0, {"prompt_too_long": 1}),
        (3, 0, {"prompt_too_long": 1}),
    ]:
        pairs, dropped = tokenize_pairs([long_reply, same], tokenizer, max_total_length=budget)
        same_reason = "identical_tokens" if budget > len(pair.prompt_ids) else "prompt_too_long"
        counts = dict.fromkeys(DROP_REASONS, 0) | expected
        counts[same_reason] += 1
        assert (len(pairs), dropped) == (kept, counts), budget


def test_bad_settings_are_refused(tokenizer: Any) -> None:
    ex = example([USER], reply("5"), reply("6"))
    with pytest.raises(ValueError, match="max_total_length=0 must be at least 1"):
        tokenize_pairs([ex], tokenizer, max_total_length=0)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_pairs([ex], bare, max_total_length=100)
