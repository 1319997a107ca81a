"""What every training loop shares, done once: the set-up chain before anything loads, the clean-up when
building fails, and the run loop around the algorithm's own step and validation.

A loop is a :class:`Trainer` subclass naming its algorithm (``algorithm = "grpo"``: its description in
:mod:`rlfleet.config.algorithm`) with three methods of its own: ``__init__`` (``super().__init__(cfg)``, then
its pieces and :meth:`Trainer.start`), ``step`` and ``validate``. :meth:`Trainer.run` is what the command line
calls: a finished run returns at once, any other starts or resumes.

The set-up chain, in this order and before any data, model or Ray actor: the resource layout (computed once),
the recipe's checks for this algorithm (:func:`rlfleet.config.check_config`), what this build cannot run
(:func:`rlfleet.config.ensure_runnable`), the algorithm's preflight (a teacher's tokenizer against the
student's), the token budgets (the recipe's, or fitted to this machine) and the memory check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from rlfleet.config import MasterConfig, check_config, ensure_runnable
from rlfleet.config.algorithm import algorithm_spec
from rlfleet.config.layout import resource_layout
from rlfleet.generation import GenerationBackend
from rlfleet.memory.planner import ensure_fits, resolve_batching
from rlfleet.policy.rank import PolicyRank
from rlfleet.runtime.components import TaskData
from rlfleet.runtime.loop import RunContext, closing_run, finished_run, run_loop, start_run


class Trainer:
    """One algorithm's run: ``Trainer.run(cfg)`` runs (or resumes) the configured job.

    Attributes:
        algorithm: The algorithm's name (its description's and its config section's).
        cfg: The validated recipe.
        spec: The algorithm's description.
        run_settings: What shared code reads of the algorithm's section (seed, step limit, validation).
        layout: The resource layout, computed once for the checks and the run.
        batching: The token budgets of its passes.
        ctx: The run's components, once :meth:`start` has built them.
    """

    algorithm: ClassVar[str]
    ctx: RunContext
    backend: GenerationBackend  # NoGeneration where the algorithm samples nothing
    data: TaskData

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg, self.spec = cfg, algorithm_spec(self.algorithm)
        self.run_settings = self.spec.settings(cfg)
        self.layout = resource_layout(cfg)
        check_config(cfg, self.spec, layout=self.layout)
        ensure_runnable(cfg, layout=self.layout)
        self.spec.run_preflight(cfg)  # what needs files but no weights
        self.batching = resolve_batching(cfg, self.layout, self.spec.name)  # the recipe's, or fitted here
        ensure_fits(cfg, self.layout, self.batching, self.spec.name)  # before any model is loaded

    def start(self, *, batch_size: int, max_val_samples: int = 1, **kwargs: Any) -> None:
        """Starts the run's components (:func:`rlfleet.runtime.loop.start_run`) with the algorithm's seed,
        step and epoch limits, reference and episode turns; ``kwargs`` go to ``start_run``."""
        s = self.run_settings
        self.ctx, self.backend, self.data = start_run(
            self.cfg,
            self.layout,
            seed=s.seed,
            keep_reference=s.keeps_reference,  # as the memory plan counts it
            max_val_samples=max_val_samples,
            batch_size=batch_size,
            max_num_steps=s.step_limit,
            max_num_epochs=s.max_num_epochs,
            max_turns=s.rollout_turns or 1,
            **kwargs,
        )

    @contextmanager
    def closing_on_failure(self) -> Iterator[None]:
        """Releases what :meth:`start` started when the block raises, then re-raises (a loop's pieces built
        after the components: a teacher, a FLOP meter)."""
        try:
            yield
        except BaseException:
            with closing_run(self.ctx):
                raise

    def step(self) -> dict[str, float]:
        """One step of the algorithm; its metrics."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        """The validation metrics (``val/...``)."""
        raise NotImplementedError

    def checkpoint_loader_state(self) -> dict[str, Any]:
        """The dataloader position a checkpoint records (a loop whose loader runs ahead gives the one before
        it did)."""
        return self.ctx.loader.state_dict()

    def close(self) -> None:
        """Releases the loop's own pieces at the end of :meth:`train` (the run's components are released by
        the run loop)."""

    def train(self) -> dict[str, float]:
        """Steps from the resumed step to the limit: validate, checkpoint, log; the last step's metrics."""
        s = self.run_settings
        try:
            return run_loop(
                self.ctx,
                self.spec.name,
                self.step,
                self.validate,
                val_period=s.val_period,
                val_at_start=s.val_at_start,
                val_at_end=s.val_at_end,
                loader_state=self.checkpoint_loader_state,
            )
        finally:
            self.close()

    @classmethod
    def run(cls, cfg: MasterConfig, *, release: bool = False, **kwargs: Any) -> dict[str, float]:
        """Runs (or resumes) the algorithm on ``cfg``; returns the last step's metrics. A run with nothing
        left to do returns at once, before anything starts. The saved config names the algorithm
        (``algorithm:``), so a checkpoint's ``config.yaml`` says what it was trained with. With ``release`` an
        in-process worker's weights are freed at the end too: another stage runs in this process next
        (``rlfleet demo``); ``kwargs`` go to the trainer."""
        if cfg.algorithm is None:
            cfg = cfg.model_copy(update={"algorithm": cls.algorithm})
        done = finished_run(cfg, cls.algorithm, algorithm_spec(cls.algorithm).settings(cfg).step_limit)
        if done is not None:
            return done
        trainer = cls(cfg, **kwargs)
        metrics = trainer.train()
        if release and isinstance(trainer.ctx.policy, PolicyRank):
            trainer.ctx.policy.release()
        return metrics
