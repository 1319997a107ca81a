"""benchmarks/gsm8k_slips.py: GSM8k's calculation marks checked exactly, on hand-made responses."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from benchmarks.gsm8k_slips import check, evaluate, load, main, summary

# GSM8k's first training solution, as the dataset writes it
RIGHT = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
SLIP = "Weng earns 12/60 = $<<12/60=0.3>>0.3 per minute.\nShe earned 0.3 x 50 = $<<0.3*50=15>>15.\n#### 15"


def test_expressions_are_evaluated_exactly_and_anything_else_is_refused() -> None:
    assert evaluate("48/2") == 24 and evaluate("12/60") == Fraction(1, 5)
    assert evaluate("0.2*50") == 10  # exact: no float rounding
    assert evaluate("(3+4)x2") == 14 and evaluate("1,200-200") == 1000 and evaluate("-3+5") == 2
    assert evaluate("2^3") == 8 and evaluate("7%4") == 3
    for bad in ("x1/0", "1/0", "a+1", "__import__('os')", "2**1000", "3+", ""):
        assert evaluate(bad) is None, bad


def test_each_response_counts_its_marks_right_and_wrong() -> None:
    assert check(RIGHT, 1.0) == check(RIGHT, 1.0).__class__(marks=2, right=2, final=True, correct=True)
    slip = check(SLIP, 0.0)
    assert (slip.marks, slip.right, slip.final, slip.correct) == (2, 1, True, False)  # 12/60 is 0.2
    none = check("The answer is 5.", 0.0)
    assert (none.marks, none.right, none.final) == (0, 0, False)
    assert check("<<1/0=1>>", 0.0).right == 0  # an expression that has no value is not right


def test_summary_and_the_printed_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [(RIGHT, 1.0), (SLIP, 0.0), ("The answer is 5.", 0.0), (RIGHT, 0.0)]
    stats = summary([check(r, w) for r, w in rows])
    assert stats["responses"] == 4 and stats["with #### N"] == 0.75 and stats["correct"] == 0.25
    assert stats["calculations right"] == pytest.approx(5 / 6) and stats["calculations per response"] == 1.5
    assert stats["every calculation right"] == 0.5
    assert stats["correct when every calculation is right"] == 0.5
    path = tmp_path / "eval.json.samples.jsonl"
    path.write_text("".join(json.dumps({"response": r, "reward": w}) + "\n" for r, w in rows))
    assert summary(load(path)) == stats
    main([str(path)])
    out = capsys.readouterr().out
    header, _, row = out.splitlines()
    assert header.split("|")[8].strip() == "calculations right"
    assert [c.strip() for c in row.split("|")[2:-1]] == [
        "4", "75.0%", "25.0%", "75.0%", "50.0%", "1.50", "83.3%", "50.0%"
    ]  # fmt: skip
