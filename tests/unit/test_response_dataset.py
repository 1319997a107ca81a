"""ResponseDataset / gsm8k loading: file formats, hub arguments, bad rows, prompt files."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.answers import InvalidGoldError, gold_answer
from rlfleet.config.schema import DataConfig
from rlfleet.data import (
    DataError,
    Example,
    build_prompts,
    load_prompt_template,
    load_task,
    load_task_with_report,
    render_prompt,
    resolve_system_prompt,
)
from rlfleet.data.prompts import check_prompt_template
from rlfleet.models.tiny import train_tokenizer

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"  # 1,319 rows, MIT
GOOD = [
    {"question": "What is 2+3?", "answer": "2+3 = 5\n#### 5"},
    {"question": "What is 1000+80?", "answer": "1000+80 = 1080\n#### 1,080"},
    {"question": "Half of 1?", "answer": "It is \\boxed{\\frac{1}{2}}."},
]
# (bad row, words the error must contain)
BAD_ROWS: dict[str, tuple[str, str]] = {
    "invalid_json": ('{"question": "x", "answer": ', "invalid JSON"),
    "not_object": ('["What is 2+3?", "#### 5"]', "not an object"),
    "missing_key": ('{"q": "What?", "answer": "#### 5"}', "keys present: ['answer', 'q']"),
    "empty_question": ('{"question": "  ", "answer": "#### 5"}', "empty question"),
    "empty_output": ('{"question": "What?", "answer": ""}', "empty output"),
    "no_gold": ('{"question": "What?", "answer": "work shown\\n#### "}', "no gold answer"),
    "rationale_without_answer": (
        '{"question": "What?", "answer": "She has 3.\\nThen 4 more."}',
        "spans several lines",
    ),
    "question_not_text": ('{"question": 7, "answer": "#### 7"}', "not text"),
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(["user assistant system hello"], 300)


class FakeHub:
    """Stands in for ``datasets.load_dataset``: records ``(path, name, split)`` and serves fixed rows."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.calls: list[tuple[str, str | None, str | None]] = []

    def __call__(self, path: str, name: str | None = None, *, split: str | None = None) -> Any:
        import datasets

        self.calls.append((path, name, split))
        return datasets.Dataset.from_list(self.rows)


def write_jsonl(path: Path, rows: list[dict[str, Any]] | list[str]) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def response_cfg(train: Path | str, val: Path | str, **kw: Any) -> DataConfig:
    return DataConfig(
        dataset_name="ResponseDataset", train_data_path=str(train), val_data_path=str(val), **kw
    )


def check_good(examples: list[Example]) -> None:
    assert [e.gold for e in examples] == ["5", "1080", "\\frac{1}{2}"]
    assert [e.question for e in examples] == [r["question"] for r in GOOD]
    assert [e.answer for e in examples] == [r["answer"] for r in GOOD]  # full output kept (SFT target)


# ----------------------------------------------------------------------------------------------- formats


def test_jsonl_rows_become_examples(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [*map(json.dumps, GOOD[:2]), "", json.dumps(GOOD[2])])
    val = write_jsonl(tmp_path / "val.jsonl", GOOD[:1])
    task = load_task_with_report(response_cfg(path, val))
    check_good(task.train)
    assert [e.gold for e in task.val] == ["5"]
    assert task.report == {"train/bad_rows": 0, "val/bad_rows": 0}


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_json_array_and_json_lines(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "train.json"
    if layout == "array":
        path.write_text(json.dumps(GOOD, indent=2), encoding="utf-8")
    else:
        write_jsonl(path, GOOD)
    train, val = load_task(response_cfg(path, path))
    check_good(train)
    check_good(val)


def test_parquet_with_custom_keys(tmp_path: Path) -> None:
    rows = [{"problem": r["question"], "solution": r["answer"], "extra": 1} for r in GOOD]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    train, _ = load_task(response_cfg(path, path, input_key="problem", output_key="solution"))
    check_good(train)


def test_gsm8k_shortcut_on_the_gsm8k_files(tmp_path: Path) -> None:
    lines = GSM8K_TEST.read_text(encoding="utf-8").splitlines(keepends=True)
    train_path = tmp_path / "train.jsonl"
    train_path.write_text("".join(lines[:200]), encoding="utf-8")  # a slice stands in for the train split
    cfg = DataConfig(dataset_name="gsm8k", train_data_path=str(train_path), val_data_path=str(GSM8K_TEST))
    task = load_task_with_report(cfg)
    assert (len(task.train), len(task.val)) == (200, 1319)
    assert task.report == {"train/bad_rows": 0, "val/bad_rows": 0}
    with_commas = [e for e in task.val if "#### 114,200" in e.answer]
    assert len(with_commas) == 1 and with_commas[0].gold == "114200"
    assert all("," not in e.gold and e.gold for e in task.train + task.val)
    assert task.train[0].gold == "18" and task.train[0].answer.endswith("#### 18")
    assert [e.question for e in task.train] == [e.question for e in task.val[:200]]


# ------------------------------------------------------------------------------------------------- hub


def test_gsm8k_defaults_reach_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    hub = FakeHub(GOOD)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    train, val = load_task(DataConfig(dataset_name="gsm8k"))
    assert hub.calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    check_good(train)
    check_good(val)


def test_response_dataset_passes_subset_and_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    hub = FakeHub([{"problem": r["question"], "solution": r["answer"]} for r in GOOD])
    monkeypatch.setattr(datasets, "load_dataset", hub)
    cfg = response_cfg(
        "org/math",
        "org/math-eval",
        subset="socratic",
        train_split="train[:3]",
        val_split="validation",
        input_key="problem",
        output_key="solution",
    )
    train, _ = load_task(cfg)
    assert hub.calls == [("org/math", "socratic", "train[:3]"), ("org/math-eval", "socratic", "validation")]
    check_good(train)


def test_gsm8k_default_applies_only_to_null_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    hub = FakeHub(GOOD)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    train = write_jsonl(tmp_path / "train.jsonl", GOOD[:2])
    task = load_task_with_report(DataConfig(dataset_name="gsm8k", train_data_path=str(train)))
    assert len(task.train) == 2
    assert hub.calls == [("openai/gsm8k", "main", "test")]  # only val fell back to the hub default


def test_hub_bad_row_and_load_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", FakeHub([GOOD[0], {"question": "x", "answer": ""}]))
    with pytest.raises(DataError, match=r"org/ds \(subset=None, split='train'\) row 1: empty output"):
        load_task(response_cfg("org/ds", "org/ds"))

    def missing(path: str, name: str | None = None, *, split: str | None = None) -> Any:
        raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(DataError, match=r"cannot load hub dataset 'org/nope'.*local \.jsonl"):
        load_task(response_cfg("org/nope", "org/nope"))


# -------------------------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_bad_row_errors_with_file_and_line(tmp_path: Path, kind: str) -> None:
    bad, words = BAD_ROWS[kind]
    path = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(GOOD[0]), bad, json.dumps(GOOD[1])])
    with pytest.raises(DataError) as info:
        load_task(response_cfg(path, path))
    message = str(info.value)
    assert "rows.jsonl:2: " in message and words in message
    assert "data.on_bad_row=skip" in message


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_bad_row_skipped_and_counted(tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    bad = BAD_ROWS[kind][0]
    train = write_jsonl(tmp_path / "train.jsonl", [bad, json.dumps(GOOD[0]), bad, json.dumps(GOOD[1])])
    val = write_jsonl(tmp_path / "val.jsonl", GOOD)
    cfg = response_cfg(train, val, on_bad_row="skip")
    task = load_task_with_report(cfg)
    assert task.report == {"train/bad_rows": 2, "val/bad_rows": 0}
    assert [e.gold for e in task.train] == ["5", "1080"]
    assert task.bad_row_samples[0].startswith(f"{train}:1: ")
    with caplog.at_level(logging.WARNING, logger="rlfleet"):
        load_task(cfg)
    assert "train/bad_rows=2" in caplog.text and "train.jsonl:3" in caplog.text


def test_parquet_and_json_array_bad_rows_name_their_position(tmp_path: Path) -> None:
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD[0], {"question": "", "answer": "#### 1"}]), parquet)
    with pytest.raises(DataError, match=r"rows\.parquet row 1: empty question"):
        load_task(response_cfg(parquet, parquet))
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([GOOD[0], {"question": "q"}], indent=2), encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.json:6: missing key"):  # the 2nd object starts on line 6
        load_task(response_cfg(array, array))


def test_json_array_syntax_error_cannot_be_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('[\n {"question": "a", "answer": "#### 1"},\n {"question": }\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.json:3: invalid JSON.*cannot recover"):
        load_task(response_cfg(path, path, on_bad_row="skip"))


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", ['{"a": 1}', "[]"])
    with pytest.raises(DataError, match=r"no usable rows \(2 bad rows skipped\)"):
        load_task(response_cfg(path, path, on_bad_row="skip"))


# ----------------------------------------------------------------------------------- paths and config


@pytest.mark.parametrize("name", ["missing.jsonl", "./missing", "data/missing.parquet"])
def test_missing_local_file(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    good = write_jsonl(tmp_path / "val.jsonl", GOOD)
    with pytest.raises(DataError, match=re.escape(f"data file '{name}' does not exist")):
        load_task(response_cfg(name, good))


def test_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"unsupported suffix '\.csv'"):
        load_task(response_cfg(path, path))


def test_response_dataset_needs_val_path(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", GOOD)
    cfg = DataConfig(dataset_name="ResponseDataset", train_data_path=str(path))
    with pytest.raises(DataError, match=r"data\.val_data_path is not set"):
        load_task(cfg)


def test_arithmetic_reports_no_bad_rows() -> None:
    task = load_task_with_report(DataConfig())
    assert task.report == {"train/bad_rows": 0, "val/bad_rows": 0}
    assert len(task.train) == DataConfig().arithmetic.num_train


@pytest.mark.parametrize(
    ("output", "gold"),
    [
        ("a\n#### 1,080", "1080"),
        ("#### $5.", "5"),
        ("#### 1 then #### -0.5\nmore", "-0.5"),
        ("#### 3/4", "3/4"),
        ("so \\boxed{\\frac{1}{2}} and", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("  just 42  ", "just 42"),
        ("#### ", None),
        ("\\boxed{}", None),
        ("\\boxed{1", None),
        ("Janet has 3 eggs.\nShe buys 4 more, so she has 7.", None),  # a rationale with no final answer
    ],
)
def test_gold_extraction(output: str, gold: str | None) -> None:
    """Dataset rows take their gold from ``rewards.gold_answer``; a row without one is a bad row."""
    if gold is None:
        with pytest.raises(InvalidGoldError):
            gold_answer(output)
    else:
        assert gold_answer(output) == gold


# ----------------------------------------------------------------------------------------------- prompts


def test_prompt_and_system_files_are_applied(tmp_path: Path, tokenizer: Any) -> None:
    template = tmp_path / "prompt.txt"
    template.write_text("{} Put the answer in \\boxed{{}}.", encoding="utf-8")
    system = tmp_path / "system.txt"
    system.write_text("Be brief.", encoding="utf-8")
    data = DataConfig(prompt_file=str(template), system_prompt_file=str(system))
    assert resolve_system_prompt(data) == "Be brief."
    tpl = load_prompt_template(data)
    assert tpl is not None
    examples = [Example(question="hello", answer="#### 1", gold="1")]
    prompts, dropped = build_prompts(
        tokenizer,
        examples,
        system_prompt=resolve_system_prompt(data),
        max_prompt_tokens=None,
        prompt_template=tpl,
    )
    assert dropped == 0 and prompts[0].example == examples[0]
    assert prompts[0].text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhello Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    plain, _ = build_prompts(tokenizer, examples, system_prompt=None, max_prompt_tokens=None)
    assert plain[0].text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    named = render_prompt(tokenizer, "hello", None, "Q: {question}\nA:")
    assert "<|im_start|>user\nQ: hello\nA:<|im_end|>" in named


def test_inline_system_prompt_still_works() -> None:
    assert resolve_system_prompt(DataConfig(system_prompt="Hi")) == "Hi"
    assert resolve_system_prompt(DataConfig()) is None


@pytest.mark.parametrize("key", ["prompt_file", "system_prompt_file"])
def test_missing_prompt_files_fail_at_load(tmp_path: Path, key: str) -> None:
    data = DataConfig(**{key: str(tmp_path / "nope.txt")})
    with pytest.raises(DataError, match=rf"data\.{key}='.*nope\.txt' does not exist"):
        load_task_with_report(data)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("no placeholder", "no placeholder"),
        ("{answer}: {}", "unknown fields"),
        ("{} in \\boxed{}", "cannot be formatted"),
        ("{unclosed", "cannot be formatted"),
    ],
)
def test_bad_prompt_templates(template: str, words: str) -> None:
    with pytest.raises(DataError, match=words):
        check_prompt_template(template)
