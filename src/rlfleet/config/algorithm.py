"""One description of each algorithm, read by everything that serves more than one.

An algorithm is known to the rest of rlfleet through its :class:`AlgorithmSpec` alone: the command line
builds its subcommand from it, the loader adds its section to the schema and finds a recipe's algorithm with
it, the checks run its own checks and know its metrics from it, the memory plan and the disk check read its
sample sizes and step limit from it, and ``plan`` and ``validate`` print its rows. No code outside an
algorithm's own folder compares the algorithm's name.

Descriptions are found, never listed: each built-in algorithm is a folder ``rlfleet/algorithms/<name>/``
whose ``spec.py`` defines ``SPEC``; an installed package adds one through the ``rlfleet.algorithms`` entry
point group (``name = "package.module:SPEC"``), and its section joins the schema
(:func:`rlfleet.config.loader.master_model`). ``docs/adding-an-algorithm.md`` walks through one.

What shared code needs of an algorithm's section is :class:`AlgorithmSettings`, read by the algorithm's own
``settings`` function from its own section, so that no helper below the loops reads another algorithm's keys
(``grpo.max_rollout_turns`` for an SFT run would silently follow a key that run ignores).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from rlfleet.config.errors import ConfigError

if TYPE_CHECKING:
    from rlfleet.config.batching import ResolvedBatching
    from rlfleet.config.layout import ResourceLayout
    from rlfleet.config.schema import MasterConfig

Algorithm = str
"""An algorithm's name: its config section and the key of its description (``grpo``, ``sft``, ...)."""

ENTRY_POINT_GROUP = "rlfleet.algorithms"
PairData = Literal["never", "optional", "always"]


@dataclass(frozen=True)
class AlgorithmSettings:
    """What shared code needs of one algorithm, as the recipe sets it.

    Attributes:
        seed: The run's seed (the policy's initialisation, the data order, the sampling seeds).
        max_num_steps: The step limit; None for none (the epochs decide: ``rm.max_num_steps=-1``).
        max_num_epochs: Passes over the training data.
        val_period: Validate every N steps (0: only at the start or end).
        val_at_start: Validate before the first step.
        val_at_end: Validate after the last step.
        rollout_turns: Model turns per episode, in training and in validation on a task; None where the
            algorithm samples nothing (a reward model: no generation engine, no environment).
        turns_key: The dotted key that sets ``rollout_turns``; None where the algorithm has no such key.
        step_rows: Sequences one step trains on.
        update_rows: Sequences of one optimizer step (a pair is two: chosen and rejected).
        logprob_rows: Sequences a step's logprob pass scores (the previous and reference policy's, or the
            teacher's top k); None where the algorithm has no logprob pass.
        keeps_reference: A frozen reference copy of the policy is kept beside it.
        has_teacher: A teacher model is loaded beside the policy.
    """

    seed: int
    max_num_steps: int | None
    max_num_epochs: int
    val_period: int
    val_at_start: bool
    val_at_end: bool
    rollout_turns: int | None
    turns_key: str | None
    step_rows: int
    update_rows: int
    logprob_rows: int | None
    keeps_reference: bool
    has_teacher: bool = False

    @property
    def samples(self) -> bool:
        """The algorithm samples from the policy (a generation engine, environments)."""
        return self.rollout_turns is not None

    @property
    def step_limit(self) -> int:
        """``max_num_steps`` as a bound on the steps (no limit: as many as the epochs give)."""
        return self.max_num_steps if self.max_num_steps is not None else sys.maxsize


@dataclass(frozen=True)
class StepFacts:
    """What ``plan`` worked out about one step, for an algorithm's own step rows.

    Attributes:
        samples_per_step: ``AlgorithmSettings.step_rows``.
        optimizer_steps: Optimizer steps per step.
        per_update: The micro-batches of one optimizer step in words, counting ``unit`` ("row", "pair").
    """

    samples_per_step: int
    optimizer_steps: int
    per_update: Callable[[str], str]


Rows = list[tuple[str, str]]


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, as everything outside its own folder knows it.

    Attributes:
        name: Its config section and key (``grpo``), also what ``--algorithm`` and ``algorithm:`` take.
        command: Its ``rlfleet`` subcommand (``grpo``, ``distill``).
        summary: One line for ``rlfleet --help``.
        section: The pydantic model of its section (added to the schema when the schema lacks it).
        trainer: ``"module:Class"`` of its trainer (an :class:`rlfleet.algorithms.base.Trainer`), imported
            only when a run starts.
        settings: Reads :class:`AlgorithmSettings` from its own section.
        metrics: The metrics it logs that ``checkpointing.metric_name`` may rank by.
        step_rows: ``plan``'s rows for one step (what it draws and how the optimizer steps split it).
        checks: Its own config checks (each problem a line naming the key, the value and a fix).
        describe: ``validate``'s and ``plan``'s rows describing it as configured.
        preflight: ``"module:function"`` run by ``validate`` after the checks: what needs files but no
            weights (a teacher's tokenizer against the student's).
        pairs: Whether it trains on (chosen, rejected) pairs: never, optionally (from a preference dataset or
            from its own samples) or always (from a preference dataset only).
        reward_model: It trains the policy as a reward model (``policy.reward_model_cfg.enabled``).
        reads: The other top-level sections it reads (GRPO's ``loss_fn``, distillation's ``teacher``).
        order: Where it comes in listings (``rlfleet --help``): lowest first, then by name.
    """

    name: str
    command: str
    summary: str
    section: type[BaseModel]
    trainer: str
    settings: Callable[[MasterConfig], AlgorithmSettings]
    metrics: frozenset[str]
    step_rows: Callable[[MasterConfig, StepFacts], Rows]
    checks: Callable[[MasterConfig, ResourceLayout], list[str]] | None = None
    describe: Callable[[MasterConfig, ResolvedBatching | None], Rows] | None = None
    preflight: str | None = None
    pairs: PairData = "never"
    reward_model: bool = False
    reads: tuple[str, ...] = field(default=())
    order: int = 100

    def trainer_class(self) -> Any:
        """The trainer class, imported now."""
        return _load(self.trainer)

    def train(self, cfg: MasterConfig) -> dict[str, float]:
        """Runs (or resumes) this algorithm on ``cfg``; returns the last step's metrics."""
        result: dict[str, float] = self.trainer_class().run(cfg)
        return result

    def run_preflight(self, cfg: MasterConfig) -> None:
        if self.preflight is not None:
            _load(self.preflight)(cfg)


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@cache
def _discovered() -> dict[str, AlgorithmSpec]:
    package = importlib.import_module("rlfleet.algorithms")  # found at run time: the layer above this one
    specs: list[AlgorithmSpec] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.ispkg and importlib.util.find_spec(f"rlfleet.algorithms.{info.name}.spec") is not None:
            specs.append(importlib.import_module(f"rlfleet.algorithms.{info.name}.spec").SPEC)
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        spec = point.load()
        if not isinstance(spec, AlgorithmSpec):
            raise ConfigError(
                f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}): got "
                f"{type(spec).__name__}, expected an rlfleet.config.algorithm.AlgorithmSpec; fix the plugin"
            )
        specs.append(spec)
    found: dict[str, AlgorithmSpec] = {}
    for spec in specs:
        clash = next((s for s in found.values() if spec.command == s.command or spec.name == s.name), None)
        if clash is not None:
            raise ConfigError(
                f"algorithm {spec.name!r} (command {spec.command!r}) is described twice (also by "
                f"{clash.trainer}); fix: uninstall one of the plugins or rename it"
            )
        found[spec.name] = spec
    return {s.name: s for s in sorted(found.values(), key=lambda s: (s.order, s.name))}


def algorithm_specs() -> tuple[AlgorithmSpec, ...]:
    """Every algorithm's description: the built-in ones, then the plugins', each once."""
    return tuple(_discovered().values())


def algorithm_names() -> tuple[str, ...]:
    return tuple(_discovered())


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The description of the algorithm called ``name``.

    Raises:
        ConfigError: no algorithm is called that (the message lists the known ones).
    """
    spec = _discovered().get(name)
    if spec is None:
        raise ConfigError(
            f"algorithm: got {name!r}, expected one of {', '.join(algorithm_names())}; fix: pass one of those"
        )
    return spec


def spec_of(algorithm: str | AlgorithmSpec) -> AlgorithmSpec:
    return algorithm if isinstance(algorithm, AlgorithmSpec) else algorithm_spec(algorithm)


def algorithm_settings(cfg: MasterConfig, algorithm: str | AlgorithmSpec) -> AlgorithmSettings:
    """What shared code needs of ``algorithm`` in ``cfg``, read from that algorithm's section alone."""
    return spec_of(algorithm).settings(cfg)


def section_of(cfg: MasterConfig, algorithm: str | AlgorithmSpec) -> Any:
    """The algorithm's own section of ``cfg``."""
    return getattr(cfg, spec_of(algorithm).name)


def loop_settings(section: Any, **rows: Any) -> AlgorithmSettings:
    """:class:`AlgorithmSettings` from a section with the loop keys every algorithm has (``seed``,
    ``max_num_steps`` (negative: none), ``max_num_epochs``, ``val_period``, ``val_at_start``,
    ``val_at_end``) and the algorithm's own row counts and flags in ``rows``."""
    steps = section.max_num_steps
    return AlgorithmSettings(
        seed=section.seed,
        max_num_steps=None if steps < 0 else steps,
        max_num_epochs=section.max_num_epochs,
        val_period=section.val_period,
        val_at_start=section.val_at_start,
        val_at_end=section.val_at_end,
        **rows,
    )


def sampled_groups(cfg: MasterConfig, name: str, **kinds: bool) -> AlgorithmSettings:
    """An algorithm that samples ``num_prompts_per_step x num_generations_per_prompt`` sequences a step and
    scores every one of them in its logprob pass (GRPO, distillation), from its own section ``name``."""
    section = getattr(cfg, name)
    samples = section.num_prompts_per_step * section.num_generations_per_prompt
    return loop_settings(
        section,
        rollout_turns=section.max_rollout_turns,
        turns_key=f"{name}.max_rollout_turns",
        step_rows=samples,
        update_rows=cfg.policy.train_global_batch_size,
        logprob_rows=samples,
        **kinds,
    )


def sampled_group_rows(cfg: MasterConfig, facts: StepFacts, name: str, then: str = "") -> Rows:
    """``plan``'s step rows of an algorithm that samples groups (:func:`sampled_groups`)."""
    section = getattr(cfg, name)
    return [
        (
            "samples per step",
            f"{section.num_prompts_per_step} x {section.num_generations_per_prompt} = "
            f"{facts.samples_per_step:,}{then}",
        ),
        (
            "optimizer steps",
            f"{facts.optimizer_steps} per step (global batch {cfg.policy.train_global_batch_size})",
        ),
        ("per update", facts.per_update("row")),
    ]
