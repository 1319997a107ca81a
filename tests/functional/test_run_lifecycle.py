"""A trainer whose constructor fails releases what it had started: reward worker processes, the policy; a
closed policy worker holds no memory, whoever still holds it."""

from __future__ import annotations

import gc
import multiprocessing
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest

import rlfleet.algorithms.grpo.loop as grpo_module
import rlfleet.runtime.loop as run_module
from rlfleet.algorithms.sft.loop import SFT
from rlfleet.data.errors import DataError
from rlfleet.models.loading import ModelSource
from rlfleet.policy.rank import PolicyRank
from tests.conftest import TEST_OPTIMIZER, pg_loss, small_grpo_config, worker_batch


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("trainer", [grpo_module.GRPO, SFT], ids=["grpo", "sft"])
@pytest.mark.parametrize("failing", ["load_prompts", "make_context"])
def test_a_failed_constructor_leaves_no_worker_behind(
    trainer: Any, failing: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = run_module  # where both trainers start their components (start_run)
    started: dict[str, Any] = {}
    real_policy, real_runners = module.build_policy, module.start_runners

    def build_policy(*args: Any, **kwargs: Any) -> Any:
        policy, backend = real_policy(*args, **kwargs)
        real_close = policy.close
        started["policy_closed"] = False

        def close() -> None:
            started["policy_closed"] = True
            real_close()

        monkeypatch.setattr(policy, "close", close)
        return policy, backend

    def start_runners(*args: Any, **kwargs: Any) -> Any:
        started["runners"] = runners = real_runners(*args, **kwargs)
        started["pids"] = [pid for pid in runners["math"].pool.worker_pids if pid is not None]
        return runners

    def bad_data(*args: Any, **kwargs: Any) -> Any:
        assert "runners" in started, "the math environment's workers should be running when this fails"
        raise DataError("val.jsonl line 3: no 'answer' field; fix the row")

    monkeypatch.setattr(module, "build_policy", build_policy)
    monkeypatch.setattr(module, "start_runners", start_runners)
    monkeypatch.setattr(module, failing, bad_data)
    cfg = small_grpo_config(tiny_model_dir, tmp_path, "env.math.num_workers=2")

    with pytest.raises(DataError, match="no 'answer' field"):
        trainer(cfg)

    assert len(started["pids"]) == 2
    left = [pid for pid in started["pids"] if _alive(pid)]
    assert not left, f"environment workers {left} outlived the failed constructor"
    assert not [p for p in multiprocessing.active_children() if p.name == "rlfleet-worker"]
    assert started["policy_closed"]


def test_a_failed_resume_closes_the_logger_and_the_workers(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loggers: list[Any] = []
    real_from_config = run_module.MetricsLogger.from_config

    def from_config(*args: Any, **kwargs: Any) -> Any:
        loggers.append(real_from_config(*args, **kwargs))
        return loggers[-1]

    def corrupt_checkpoint(ctx: Any) -> None:
        raise RuntimeError("step_2/policy is unreadable")

    monkeypatch.setattr(run_module.MetricsLogger, "from_config", from_config)
    monkeypatch.setattr(run_module, "resume", corrupt_checkpoint)
    with pytest.raises(RuntimeError, match="unreadable"):
        grpo_module.GRPO(small_grpo_config(tiny_model_dir, tmp_path))
    assert len(loggers) == 1 and loggers[0]._closed
    assert not [p for p in multiprocessing.active_children() if p.name == "rlfleet-worker"]


def test_closing_frees_adamw_and_releasing_frees_the_weights_even_when_the_worker_is_still_referenced(
    tiny_model_dir: Path,
) -> None:
    """``rlfleet demo`` runs SFT and GRPO in one process, and vLLM's engine start keeps the frames that built
    the SFT stage's worker alive: its weights and AdamW moments (3 GiB for Gemma 3 270M) stayed through the
    GRPO stage. Closing a worker frees its AdamW state (the weights stay readable after a run); releasing it
    (``sft_train(..., release=True)``, as the demo runs its SFT stage) frees the weights too, though the
    worker object lives on."""
    worker = PolicyRank(ModelSource(str(tiny_model_dir), "float32"), TEST_OPTIMIZER, keep_reference=True)
    batch = worker_batch(worker)
    worker.train(batch, pg_loss(), global_batch_size=len(batch), micro_batching=len(batch))
    weight = next(worker.model.parameters())
    moments = [weakref.ref(t) for t in worker.optimizer.state[weight].values()]
    assert moments, "AdamW has state after a step"

    worker.close()
    gc.collect()
    assert [t() for t in moments] == [None] * len(moments)
    assert not worker.model.lm_head.weight.is_meta  # still the trained model

    weights = [weakref.ref(weight), weakref.ref(next(worker.reference.parameters()))]
    del weight
    worker.release()
    gc.collect()
    assert [t() for t in weights] == [None, None]
    assert all(p.is_meta for p in worker.model.parameters())
