"""A built-in, seeded, procedurally generated task: arithmetic word problems in GSM8k format.

Each problem starts with a quantity and applies ``min_ops..max_ops`` operations to it. The worked answer
writes one equation per line and ends with ``#### N``, as GSM8k does, so everything downstream (prompts,
rewards, SFT targets) treats this task exactly like GSM8k.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from rlfleet.data.types import Example

_NAMES = (
    "Ava",
    "Ben",
    "Cleo",
    "Dan",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivo",
    "Jade",
    "Kai",
    "Lena",
    "Max",
    "Nora",
)
_ITEMS = ("apples", "books", "coins", "pens", "stamps", "shells", "cards", "marbles", "eggs", "stickers")
_PHRASES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} buys {n} more {item}.",
        "{name} finds {n} more {item}.",
        "A friend gives {name} {n} {item}.",
    ),
    "-": ("{name} gives away {n} {item}.", "{name} loses {n} {item}.", "{name} sells {n} {item}."),
    "*": ("Then the number of {item} becomes {n} times as large.", "{name} ends up with {n} times as many."),
}
_SYMBOL = {"+": "+", "-": "-", "*": "*"}


def _apply(op: str, total: int, n: int) -> int:
    if op == "+":
        return total + n
    if op == "-":
        return total - n
    return total * n


def _pick_operand(rng: random.Random, op: str, total: int, max_operand: int) -> int:
    if op == "-":
        return rng.randint(1, max(1, min(total, max_operand)))  # never go below zero
    if op == "*":
        return rng.randint(2, max(2, min(5, max_operand)))
    return rng.randint(1, max_operand)


def make_problem(
    rng: random.Random, *, min_ops: int, max_ops: int, max_operand: int, operations: Sequence[str]
) -> Example:
    """Draws one word problem. Pure given the ``rng`` state."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(1, max_operand)
    sentences = [f"{name} has {total} {item}."]
    lines = []
    for _ in range(rng.randint(min_ops, max_ops)):
        allowed = [op for op in operations if op != "-" or total > 0]
        op = rng.choice(allowed or ["+"])
        n = _pick_operand(rng, op, total, max_operand)
        new_total = _apply(op, total, n)
        sentences.append(rng.choice(_PHRASES[op]).format(name=name, item=item, n=n))
        lines.append(f"{total} {_SYMBOL[op]} {n} = {new_total}")
        total = new_total
    sentences.append(f"How many {item} does {name} have now?")
    answer = "\n".join([*lines, f"#### {total}"])
    return Example(question=" ".join(sentences), answer=answer, gold=str(total))


def generate_arithmetic(
    num: int, *, seed: int, min_ops: int, max_ops: int, max_operand: int, operations: Sequence[str]
) -> list[Example]:
    """Generates ``num`` problems; the same arguments always give the same list."""
    rng = random.Random(seed)
    return [
        make_problem(rng, min_ops=min_ops, max_ops=max_ops, max_operand=max_operand, operations=operations)
        for _ in range(num)
    ]


def arithmetic_splits(
    *,
    num_train: int,
    num_val: int,
    seed: int,
    min_ops: int,
    max_ops: int,
    max_operand: int,
    operations: Sequence[str],
) -> tuple[list[Example], list[Example]]:
    """Train and validation splits with no validation question appearing in train."""
    shape = {"min_ops": min_ops, "max_ops": max_ops, "max_operand": max_operand}
    val = generate_arithmetic(num_val, seed=seed + 1, **shape, operations=operations)
    val_questions = {ex.question for ex in val}
    train: list[Example] = []
    rng = random.Random(seed)
    for _ in range(20 * num_train + 1000):
        if len(train) == num_train:
            return train, val
        ex = make_problem(rng, **shape, operations=operations)
        if ex.question not in val_questions:
            train.append(ex)
    raise ValueError(
        f"could not draw {num_train} training problems distinct from the {num_val} validation ones; "
        "raise data.arithmetic.max_operand or max_ops, or lower num_val"
    )


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` (a worked answer of :func:`make_problem`) with its last equation's result, and so the
    final answer, off by 1 to 3 (never below 0): the same steps and format, one arithmetic slip."""
    *steps, last, _ = answer.split("\n")  # the last line is "#### <result>"
    left, _, result = last.rpartition(" = ")
    right = int(result)
    wrong = rng.choice([right + d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0])
    return "\n".join([*steps, f"{left} = {wrong}", f"#### {wrong}"])


def arithmetic_pairs(
    *, num_train: int, num_val: int, seed: int, max_operand: int, min_ops: int = 1, max_ops: int = 2
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Preference rows (``BinaryPreferenceDataset``: prompt, chosen, rejected) of arithmetic word problems:
    the worked answer chosen, the same answer with a slip in its last step (:func:`wrong_answer`) rejected;
    train and validation questions distinct (:func:`arithmetic_splits`, additions and subtractions)."""
    splits = arithmetic_splits(
        num_train=num_train,
        num_val=num_val,
        seed=seed,
        min_ops=min_ops,
        max_ops=max_ops,
        max_operand=max_operand,
        operations=["+", "-"],
    )
    rng = random.Random(seed)

    def rows(examples: list[Example]) -> list[dict[str, str]]:
        return [
            {"prompt": ex.question, "chosen": ex.answer, "rejected": wrong_answer(ex.answer, rng)}
            for ex in examples
        ]

    return rows(splits[0]), rows(splits[1])


def write_arithmetic_pairs(out_dir: Path, **shape: int) -> tuple[Path, Path]:
    """Writes :func:`arithmetic_pairs` (its keyword arguments ``shape``) as ``out_dir/train.jsonl`` and
    ``out_dir/val.jsonl``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "train.jsonl", out_dir / "val.jsonl")
    for path, rows in zip(paths, arithmetic_pairs(**shape), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


# --- multiplication with a calculator -----------------------------------------------------------------------

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'


def tool_transcript(a: int, b: int) -> str:
    """The episode a tool-using model should produce for ``a * b`` after its prompt, in ChatML (the tiny
    model's and SmolLM2's chat format): call the calculator, read its result, answer with ``#### N``. The
    tool message is what the ``tools`` environment renders (:class:`~rlfleet.data.prompts.
    ObservationTemplate`), so SFT on this text teaches exactly the turns GRPO then samples."""
    return CALL.format(a=a, b=b) + tool_message(a * b) + f"#### {a * b}"


def tool_message(result: int) -> str:
    """The calculator's answer as the ``tools`` environment renders it after a call (ChatML): context the
    model reads, not text it writes (SFT masks it: ``context_spans``)."""
    return f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def multiplication_problems(
    num: int, *, seed: int, min_digits: int, max_digits: int, sft_target: str, exclude: set[str] | None = None
) -> list[Example]:
    """``num`` distinct problems "What is A * B?" with operands of ``min_digits..max_digits`` digits.

    ``sft_target`` is the answer an SFT warm start learns: ``tool`` (:func:`tool_transcript`) or ``direct``
    (``A * B = N`` then ``#### N``, what a model without the tool must compute itself)."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Example] = []
    for _ in range(50 * num + 1000):
        if len(out) == num:
            return out
        a, b = (_operand(rng, rng.randint(min_digits, max_digits)) for _ in "ab")
        question = f"What is {a} * {b}?"
        if question in seen:
            continue
        seen.add(question)
        if sft_target == "tool":
            answer, extra = tool_transcript(a, b), {"context_spans": [tool_message(a * b)]}
        else:
            answer, extra = f"{a} * {b} = {a * b}\n#### {a * b}", None
        out.append(Example(question=question, answer=answer, gold=str(a * b), extra=extra))
    raise ValueError(f"could not draw {num} distinct multiplication problems; widen the digit range")
