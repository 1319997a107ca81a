"""Plot a run's ``metrics.jsonl``: train reward (with moving average; the train loss for a run without
rewards, such as SFT), validation accuracy and KL; and a pipeline's validation accuracy across its stages.

Uses :class:`matplotlib.figure.Figure` directly (rendered by the Agg canvas), so it never touches pyplot's
global state or the process-wide backend selection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlfleet.logging.metrics import read_metrics

REWARD_KEY = "train/reward"
LOSS_KEY = "train/loss"
VAL_ACC_KEY = "val/accuracy"
KL_KEY = "train/kl"


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(steps, values)`` sorted by step; later lines win for repeated steps; null → NaN."""
    by_step: dict[int, float] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or key not in record:
            continue
        value = record[key]
        try:
            by_step[step] = float(value) if value is not None else math.nan
        except (TypeError, ValueError):
            by_step[step] = math.nan
    steps = sorted(by_step)
    return np.asarray(steps, dtype=float), np.asarray([by_step[s] for s in steps], dtype=float)


def _finite(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mask = np.isfinite(values)
    return steps[mask], values[mask]


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average; the first ``window - 1`` points average over what is available."""
    if values.size == 0:
        return values
    window = max(1, min(window, values.size))
    cumsum = np.concatenate(([0.0], np.cumsum(values, dtype=float)))
    end = np.arange(1, values.size + 1)
    start = np.maximum(0, end - window)
    averaged: np.ndarray = (cumsum[end] - cumsum[start]) / (end - start)
    return averaged


def _no_data(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_train(ax: Axes, records: list[dict[str, Any]]) -> None:
    """The train reward per step with a moving average; for a run that logs no reward (SFT, DPO, a reward
    model), its train loss."""
    rewards = _finite(*_series(records, REWARD_KEY))
    key, name = (REWARD_KEY, "reward") if rewards[0].size else (LOSS_KEY, "loss")
    steps, values = rewards if key == REWARD_KEY else _finite(*_series(records, key))
    title = f"train {name}"
    if steps.size == 0:
        _no_data(ax, "train reward")
        return
    window = min(20, max(2, steps.size // 5), steps.size)
    marker = "." if steps.size < 50 else None
    ax.plot(steps, values, color="tab:blue", alpha=0.35, marker=marker, label=name)
    smoothed = moving_average(values, window)
    ax.plot(steps, smoothed, color="tab:blue", linewidth=2, label=f"moving avg ({window})")
    ax.set_title(title)
    ax.set_ylabel(name)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _plot_val(ax: Axes, records: list[dict[str, Any]]) -> None:
    steps, values = _finite(*_series(records, VAL_ACC_KEY))
    title = "validation accuracy"
    if steps.size == 0:
        _no_data(ax, title)
        return
    ax.plot(steps, values, color="tab:green", marker="o", linestyle="-", label="val accuracy")
    ax.set_title(title)
    ax.set_ylabel("accuracy")
    ax.grid(True, alpha=0.3)


def _plot_kl(ax: Axes, records: list[dict[str, Any]]) -> None:
    steps, values = _finite(*_series(records, KL_KEY))
    title = "train KL"
    if steps.size == 0:
        _no_data(ax, title)
        return
    ax.plot(steps, values, color="tab:red", marker="." if steps.size < 50 else None)
    ax.set_title(title)
    ax.set_ylabel("kl")
    ax.grid(True, alpha=0.3)


def plot_run(log_dir: Path, out: Path | None = None) -> Path:
    """Renders ``<log_dir>/metrics.jsonl`` to a PNG and returns its path.

    Panels: train reward per step with a moving average (the train loss where no reward was logged),
    validation accuracy per step (markers) and, when ``train/kl`` was logged, a smaller KL panel. A panel
    whose key is missing (or all null) says "no data".

    Args:
        log_dir: Run directory holding ``metrics.jsonl``.
        out: Output PNG path; defaults to ``<log_dir>/plot.png``.

    Returns:
        The path written.
    """
    log_dir = Path(log_dir)
    out = Path(out) if out is not None else log_dir / "plot.png"
    fig = run_figure(read_metrics(log_dir))
    resolved = log_dir.resolve()
    fig.suptitle(f"run: {resolved.parent.name}/{resolved.name}")
    return _save(fig, out)


def run_figure(records: list[dict[str, Any]]) -> Figure:
    """The panels of ``plot_run`` for these metrics records."""
    has_kl = any(KL_KEY in record for record in records)
    ratios = [3, 3, 1.5] if has_kl else [3, 3]
    fig = Figure(figsize=(9, sum(ratios) + 1.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ratios), 1, sharex=False, gridspec_kw={"height_ratios": ratios})
    _plot_train(axes[0], records)
    _plot_val(axes[1], records)
    if has_kl:
        _plot_kl(axes[2], records)
    all_steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    if all_steps:  # align the x axes of the panels that have data
        lo, hi = min(all_steps), max(all_steps)
        pad = max(0.5, 0.02 * (hi - lo))
        for ax in axes:
            if ax.lines:
                ax.set_xlim(lo - pad, hi + pad)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("step")
    return fig


def _save(fig: Figure, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def stage_curves(
    stages: Sequence[tuple[str, Path]],
) -> list[tuple[str, np.ndarray, np.ndarray, float]]:
    """Each stage's validation accuracy on one step axis: ``(name, steps, accuracies, first step)``, a
    stage's steps counted on from the last step of the stage before it (a stage's step 0, its validation at
    start, lands on the previous stage's last step)."""
    curves, offset = [], 0.0
    for name, log_dir in stages:
        records = read_metrics(Path(log_dir))
        steps, values = _finite(*_series(records, VAL_ACC_KEY))
        curves.append((name, steps + offset, values, offset))
        all_steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
        offset += max(all_steps, default=0)
    return curves


def plot_stages(stages: Sequence[tuple[str, Path]], out: Path, title: str = "") -> Path:
    """One PNG of a pipeline's validation accuracy across its stages (``stages``: name and log
    directory, in order; e.g. SFT then GRPO), each stage in its own colour, a dashed line where the next
    begins; returns ``out``."""
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    curves = stage_curves(stages)
    colours = ["tab:purple", "tab:green", "tab:orange", "tab:blue"]
    for i, (name, steps, values, start) in enumerate(curves):
        if i:
            ax.axvline(start, color="gray", linestyle="--")
        if steps.size:
            ax.plot(steps, values, marker="o", color=colours[i % len(colours)], label=name)
    if not ax.lines:
        _no_data(ax, "validation accuracy")
    else:
        ax.set_title("validation accuracy")
        ax.set_ylabel("accuracy")
        ax.set_xlabel("step (the stages one after the other)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, Path(out))
