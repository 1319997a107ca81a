"""Console output: a tqdm progress bar over the steps, with a readable line for each validation step and the
last one (without a terminal, plain lines: those, and about 20 more per run)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from tqdm import tqdm

from rlfleet.logging.capture import terminal


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda value: f"{value:.{digits}f}"


def _small(value: float) -> str:
    """4 decimals, switching to scientific notation for tiny non-zero values (e.g. early KL)."""
    if value != 0 and math.isfinite(value) and abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4f}"


def _count(value: float) -> str:
    return f"{round(value):,}" if math.isfinite(value) else str(value)


# (metric key, label, formatter) in display order.
_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("train/reward", "reward", _fixed(3)),
    ("train/accuracy", "acc", _fixed(3)),
    ("train/kl", "kl", _small),
    ("train/loss", "loss", _small),
    ("train/grad_norm", "gnorm", _fixed(2)),
    ("train/num_tokens", "tok", _count),
)
_TIMINGS: tuple[tuple[str, str], ...] = (
    ("timing/generation", "gen"),
    ("timing/generation_wait", "wait"),
    ("timing/env", "env"),
    ("timing/logprobs", "lp"),
    ("timing/teacher", "teacher"),
    ("timing/training", "train"),
    ("timing/refit", "refit"),
    ("timing/checkpoint", "ckpt"),
)
# Shown only when they took measurable time (an in-process refit is a no-op; asynchronous GRPO waits for
# the next step's generation only when it outlasts the training).
_ONLY_WHEN_SLOW = {"timing/refit": 0.05, "timing/generation_wait": 0.05}


def _get(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _timing_part(metrics: Mapping[str, Any]) -> str | None:
    total = _get(metrics, "timing/total")
    subs = [
        (label, value)
        for key, label in _TIMINGS
        if (value := _get(metrics, key)) is None or value >= _ONLY_WHEN_SLOW.get(key, 0.0)
    ]
    sub_text = " ".join(f"{label} {value:.1f}" for label, value in subs if value is not None)
    if total is None and not sub_text:
        return None
    text = "time" if total is None else f"time {total:.1f}s"
    slowest = _slowest_phase(subs, total)
    if slowest:
        sub_text = f"{sub_text}, {slowest}"
    return f"{text} ({sub_text})" if sub_text else text


def _slowest_phase(subs: list[tuple[str, float | None]], total: float | None) -> str | None:
    """``slowest gen 59%``: the phase that took the largest share of the step (where the time goes)."""
    timed = [(value, label) for label, value in subs if value is not None]
    if total is None or total <= 0 or len(timed) < 2:
        return None
    value, label = max(timed)
    return f"slowest {label} {100 * value / total:.0f}%"


def format_step_line(step: int, total: int, metrics: Mapping[str, float]) -> str:
    """Formats one step's metrics as a single human-readable line.

    Example: ``step 12/100 | reward 0.438 | acc 0.500 | kl 0.0012 | loss -0.0131 | gnorm 0.82 |
    tok 4,312 | time 3.2s (gen 1.9 env 0.0 lp 0.3 train 0.9 ckpt 0.0, slowest gen 59%) | val_acc 0.530``.
    ``mfu`` (model FLOPs utilisation of the training pass) appears where it is measured (on GPUs).
    Missing (or ``None``) metrics are skipped.
    """
    parts = [f"step {step}/{total}" if total > 0 else f"step {step}"]
    for key, label, fmt in _FIELDS:
        value = _get(metrics, key)
        if value is not None:
            parts.append(f"{label} {fmt(value)}")
    timing = _timing_part(metrics)
    if timing is not None:
        parts.append(timing)
    mfu = _get(metrics, "perf/training_mfu")
    if mfu is not None:
        parts.append(f"mfu {100 * mfu:.1f}%")
    val_acc = _get(metrics, "val/accuracy")
    if val_acc is not None:
        val_s = _get(metrics, "timing/validation")
        parts.append(f"val_acc {val_acc:.3f}" + (f" ({val_s:.1f}s)" if val_s is not None else ""))
    return " | ".join(parts)


PLAIN_LINES_PER_RUN = 20  # without a bar: about this many step lines per run, besides validations


def prints_step_line(step: int, total: int, validated: bool, bar_active: bool) -> bool:
    """Whether step ``step`` gets its own console line: a validation step or the last one always; the
    others never under a progress bar (it shows them), else about :data:`PLAIN_LINES_PER_RUN` per run."""
    if validated or step >= total:
        return True
    return not bar_active and step % max(1, total // PLAIN_LINES_PER_RUN) == 0


def bar_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The latest step's headline numbers, shown beside the bar."""
    shown = {"train/reward": "reward", "train/accuracy": "acc", "timing/total": "s/step"}
    return {
        label: f"{value:.3g}" for key, label in shown.items() if (value := _get(metrics, key)) is not None
    }


class Progress:
    """A tqdm progress bar over training steps that falls back to plain prints.

    The bar is shown only when ``enabled`` and stderr is a TTY. Either way :meth:`write` emits the line:
    through ``tqdm.write`` (so it does not break the bar) or as a plain ``print`` to stdout.

    Args:
        total: Total number of steps.
        initial: Steps already done (e.g. when resuming from a checkpoint).
        desc: Bar label.
        enabled: Whether to draw a bar at all.
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "train", enabled: bool = True) -> None:
        self.total = total
        self.n = initial
        self._bar: tqdm[Any] | None = None
        err = terminal("err")
        if enabled and err is not None and err.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=err)

    @property
    def bar_active(self) -> bool:
        """Whether a tqdm bar is being drawn."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def write(self, line: str) -> None:
        if self._bar is not None:
            tqdm.write(line, file=terminal("err"))
        else:
            print(line, flush=True, file=terminal())

    def set_postfix(self, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.set_postfix(**kwargs)

    def step_done(self, step: int, metrics: Mapping[str, Any], validated: bool) -> None:
        """Advances the bar to ``step`` and prints the step's line when :func:`prints_step_line` says so."""
        self.update()
        self.set_postfix(**bar_postfix(metrics))
        if prints_step_line(step, self.total, validated, self.bar_active):
            self.write(format_step_line(step, self.total, metrics))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
