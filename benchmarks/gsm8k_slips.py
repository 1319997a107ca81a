"""Where GSM8k answers go wrong: the arithmetic a model writes, checked step by step.

GSM8k's worked solutions mark each calculation as ``<<48/2=24>>24``, and a model fine-tuned on them writes
the same marks. This reads the scored responses ``rlfleet eval --out FILE`` writes (``FILE.samples.jsonl``:
``response``, ``reward``) and checks every mark's arithmetic (the expression evaluated exactly, against the
result the model wrote), then prints: responses with a final ``#### N`` line, correct ones, responses whose
every calculation is right, the share of calculations that are right, and accuracy among the responses
without a slip. A low share of right calculations with a high share of well-formed answers says the limit
is the model's arithmetic, not the format or the method.

    .venv/bin/rlfleet eval runs/gemma3/sft_model ... --out /tmp/sft.json
    .venv/bin/python benchmarks/gsm8k_slips.py /tmp/sft.json.samples.jsonl [MORE.samples.jsonl ...]
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

MARK = re.compile(r"<<([^<>=]+)=([^<>]*)>>")
FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}


def evaluate(expression: str) -> Fraction | None:
    """The exact value of an arithmetic expression (numbers, + - * / % ** and parentheses; ``x`` as
    multiplication), or None for anything else (names, division by zero, huge powers)."""
    text = expression.replace(",", "").replace("x", "*").replace("^", "**").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 12):
                raise ValueError("power")
            return Fraction(OPERATORS[type(node.op)](left, right))
        raise ValueError(type(node).__name__)

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def number(text: str) -> Fraction | None:
    """The number a mark's result states (``24``, ``0.2``, ``1,200``), or None."""
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


@dataclass(frozen=True)
class Checked:
    marks: int  # calculations marked <<...=...>>
    right: int  # of them, whose stated result equals the expression's value (to 1e-6)
    final: bool  # a "#### N" line
    correct: bool  # the reward said so


def check(response: str, reward: float) -> Checked:
    """One response's calculations and final line (``reward > 0.5`` is correct, as rlfleet scores)."""
    marks = right = 0
    for expression, stated in MARK.findall(response):
        marks += 1
        got, said = evaluate(expression), number(stated)
        right += got is not None and said is not None and abs(float(got - said)) <= 1e-6
    return Checked(marks, right, FINAL.search(response) is not None, reward > 0.5)


def summary(checked: Sequence[Checked]) -> dict[str, float]:
    n = len(checked)
    marks = sum(c.marks for c in checked)
    clean = [c for c in checked if c.marks and c.right == c.marks]
    return {
        "responses": n,
        "with #### N": sum(c.final for c in checked) / n,
        "correct": sum(c.correct for c in checked) / n,
        "with calculations": sum(c.marks > 0 for c in checked) / n,
        "every calculation right": len(clean) / n,
        "calculations per response": marks / n,
        "calculations right": sum(c.right for c in checked) / marks if marks else 0.0,
        "correct when every calculation is right": sum(c.correct for c in clean) / len(clean)
        if clean
        else 0.0,
    }


def load(path: Path) -> list[Checked]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [check(str(r["response"]), float(r["reward"])) for r in rows]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "samples", nargs="+", type=Path, help="FILE.samples.jsonl from rlfleet eval --out FILE"
    )
    args = parser.parse_args(argv)
    tables = {str(p): summary(load(p)) for p in args.samples}
    keys = list(next(iter(tables.values())))
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in tables.items():
        cells = [f"{row[k]:.0f}" if k == "responses" else f"{row[k]:.1%}" for k in keys]
        cells[keys.index("calculations per response")] = f"{row['calculations per response']:.2f}"
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
