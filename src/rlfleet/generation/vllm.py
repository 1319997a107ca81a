"""Generation with a vLLM engine beside the trainer (colocated, one process), refit after every update.

The engine runs in its own process (vLLM starts it with ``spawn``: a script that builds this backend needs
the ``if __name__ == "__main__":`` guard), or in this one (``VLLMSettings.in_process``: a dedicated
generation worker on Ray). It never reads the policy's checkpoint: it starts from a
directory holding the policy's config and tokenizer, and its weights come from the trainer, written as
safetensors files of bounded size (the float32 masters cast to the engine dtype: the buckets of
:mod:`rlfleet.generation.weights`) and loaded by the worker extension in
:mod:`rlfleet.generation.vllm_worker_ext`. With ``load_format="dummy"`` the engine starts with random
weights and the constructor refits before anything can generate; such an engine starts from a directory
named by the model's config and tokenizer (:func:`shared_model_dir`), so vLLM's compilation cache, keyed by
that path, is warm the next time the same model starts.

On a GPU shared with training the engine sleeps between generations (NeMo RL's order): ``sleep(level=1)``
after generating frees the KV cache and offloads the weights for training; ``refit`` wakes the weights,
loads the new ones, then wakes the KV cache. The CPU build has no sleep mode; a dedicated engine
(``VLLMSettings.shares_gpu=False``) stays awake.

An engine with no trainer model beside it (a generation worker on Ray,
:meth:`VLLMGenerationBackend.receiving`) starts from the config alone with dummy weights; the weights it
receives (gathered by its training rank, or by broadcast) go through
:meth:`VLLMGenerationBackend.load_buckets`, the same files-and-reload path, and it refuses to generate until
they have arrived.

Sampling: one request per row seeded with :func:`rlfleet.generation.sampling.row_seeds` (the HF backend's
per-row seeds, so a row reproduces whatever else is in the batch; vLLM's sampler draws differently from
HF's, so the samples themselves differ). The returned logprobs are vLLM's ``processed_logprobs``: the
sampled token under ``softmax(logits / temperature)``, as the trainer computes them (top-k/top-p with
vLLM is refused in ``rlfleet.config.checks``: vLLM would report them under the filtered
distribution).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlfleet.config.backends import BACKENDS
from rlfleet.generation.interface import GenerationResult, SamplingParams
from rlfleet.generation.sampling import row_seeds
from rlfleet.generation.weights import buckets, engine_state
from rlfleet.models.loading import DTYPES

log = logging.getLogger("rlfleet")

EXTENSION = "rlfleet.generation.vllm_worker_ext.WeightReloadExtension"
CPU_KV_CACHE_GIB = str(BACKENDS["vllm"].cpu_kv_cache_gib)  # VLLM_CPU_KVCACHE_SPACE when unset
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# On a CPU vLLM keeps one core per worker for its scheduler process; in synchronous GRPO the engine runs
# alone while it generates, so its worker computes on every core instead (benchmarks/vllm_cpu_setup.py).
CPU_RESERVED_DEFAULT = "0"


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's settings (``policy.generation.vllm_cfg`` with its nulls resolved).

    Attributes:
        precision: Engine dtype name (``float32``, ``bfloat16``, ``float16``).
        max_model_len: Context length (prompt + response tokens).
        seed: The engine's own seed (each request also carries its row seed).
        enforce_eager: Skip CUDA graphs.
        load_format: ``auto`` (start from the policy's weights) or ``dummy`` (random, refit at once).
        gpu_memory_utilization: Share of the GPU the engine may take (weights + KV cache).
        tensor_parallel_size: GPUs per engine.
        engine_kwargs: Passed through to ``vllm.LLM`` last (``vllm_cfg.vllm_kwargs``).
        shares_gpu: The engine shares its GPU with training (colocated): on a GPU it sleeps between
            generations. A dedicated engine has its GPUs to itself and stays awake.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` of the engine's processes (a colocated tensor-parallel
            engine spans its training ranks' GPUs); None: this process's.
        in_process: Run the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as NeMo RL's
            generation workers do) instead of a process of its own; with one worker, the worker too. For a
            process that hosts nothing but the engine (a dedicated generation worker): one or two process
            starts fewer (each imports torch and vLLM again) and no engine-core process in memory. A
            colocated engine keeps its own processes: in a training rank's process vLLM's CPU worker would
            take over the trainer's threads.
    """

    precision: str
    max_model_len: int
    seed: int
    enforce_eager: bool = False
    load_format: str = "auto"
    gpu_memory_utilization: float = 0.6
    tensor_parallel_size: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    shares_gpu: bool = True
    visible_devices: str | None = None
    in_process: bool = False


def cpu_scheduling(max_model_len: int) -> dict[str, Any]:
    """Scheduler settings the CPU build needs for seeded sampling: no chunked prefill.

    When a prompt's prefill is split over engine steps, vLLM rewinds the request's torch generator
    (``set_offset``), which a CPU generator does not support: the engine dies ("CPU Generator does not use
    offset") as soon as a step's prompts exceed the token budget. Without chunking a prompt waits for the
    next step instead, so the budget must hold the longest one. GPUs keep vLLM's defaults.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def _scratch_dir() -> str:
    """Where refit files go: RAM-backed ``/dev/shm`` when there is one, else the temp directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def shared_model_dir(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """A directory with the model's config and tokenizer and no weights, named by their content, for an
    engine that starts with dummy weights.

    vLLM keys its compilation cache by the model path (among the graph's settings): a fresh temporary
    directory per run made every engine compile again (about a minute on a CPU, see
    ``benchmarks/vllm_cpu_setup.py``); this one is the same for the same model, so a later run of it finds
    the compiled graph. Written once (staged, then renamed into place; a concurrent writer of the same
    content wins or loses the rename harmlessly) and never removed: it holds a few megabytes of text.
    """
    staging = Path(tempfile.mkdtemp(prefix="rlfleet-vllm-staging-"))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        digest = hashlib.sha256()
        for path in sorted(staging.iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        final = Path(tempfile.gettempdir()) / f"rlfleet-vllm-config-{digest.hexdigest()[:20]}"
        if not final.is_dir():
            with contextlib.suppress(OSError):  # lost a race to an identical directory
                staging.rename(final)
        return str(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """Sets ``os.environ[name]`` for the block (nothing when ``value`` is None), then restores it."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


class VLLMGenerationBackend:
    """Samples with a vLLM engine that holds its own copy of the policy's weights.

    Args:
        model: The trainer's model (float32 masters); its state dict is what ``refit`` sends. None for an
            engine whose weights arrive through ``load_buckets`` only (see ``receiving``).
        tokenizer: The policy's tokenizer: saved for the engine, and decodes responses.
        settings: The engine's settings.
        config: The model's config when ``model`` is None (the engine's architecture).
    """

    def __init__(
        self,
        model: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
        settings: VLLMSettings,
        *,
        config: PretrainedConfig | None = None,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("vLLM generation needs a tokenizer with an eos token")
        if model is not None:
            config = model.config
        elif config is None:
            raise ValueError("pass the trainer's model, or (for an engine refitted by load_buckets) a config")
        self.model = model
        self.config: PretrainedConfig = config
        self.tokenizer = tokenizer
        # without a model there are no weights to write: the engine starts dummy and waits for load_buckets
        self.settings = settings if model is not None else replace(settings, load_format="dummy")
        self.dtype = DTYPES[settings.precision]
        self.sleeps = settings.shares_gpu and torch.cuda.is_available()  # sleep mode is a GPU feature
        self.asleep = False
        self.has_weights = self.settings.load_format == "auto"
        self.llm: Any = None
        self.model_dir = ""  # the engine's directory: its own with the weights, else shared (see below)
        self.owns_model_dir = self.has_weights
        try:
            if self.owns_model_dir:
                self.model_dir = tempfile.mkdtemp(prefix="rlfleet-vllm-model-")
                self._write_model_dir()
            else:
                self.model_dir = shared_model_dir(self.config, self.tokenizer)
            self.llm = self._start_engine()
            if model is not None and not self.has_weights:
                self.refit()  # the engine's random weights never generate
        except BaseException:
            self.close()
            raise

    @classmethod
    def receiving(
        cls, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, settings: VLLMSettings
    ) -> VLLMGenerationBackend:
        """An engine with no trainer model beside it: it starts with dummy weights and generates only once
        ``load_buckets`` has given it the policy's (``settings.load_format`` is not used)."""
        return cls(None, tokenizer, settings, config=config)

    def _write_model_dir(self) -> None:
        self.config.save_pretrained(self.model_dir)
        self.tokenizer.save_pretrained(self.model_dir)
        if self.has_weights and self.model is not None:  # vLLM loads every *.safetensors file there
            for i, bucket in enumerate(buckets(engine_state(self.model), self.dtype)):
                path = Path(self.model_dir) / f"model-{i + 1:05d}.safetensors"
                save_file(bucket, str(path), metadata={"format": "pt"})

    def _start_engine(self) -> Any:
        from vllm import LLM  # the vllm / vllm-cpu extra

        s = self.settings
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        os.environ.setdefault(RESERVED_CPU_ENV, CPU_RESERVED_DEFAULT)
        if not torch.cuda.is_available():
            # vllm-cpu 0.32 saves AOT-compiled graphs it cannot load back ("'function' object has no
            # attribute 'finalize_loading'") and compiles again every start; its other compile cache
            # works, so a second start of the same model is faster without the AOT one.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": s.precision,
            "max_model_len": s.max_model_len,
            "seed": s.seed,
            "enforce_eager": s.enforce_eager,
            "load_format": s.load_format,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "tensor_parallel_size": s.tensor_parallel_size,
            "worker_extension_cls": EXTENSION,
            "logprobs_mode": "processed_logprobs",  # after temperature, as the trainer scores them
            "generation_config": "vllm",  # ignore the checkpoint's sampling defaults, as the HF backend does
            "enable_sleep_mode": self.sleeps,
            **cpu_scheduling(s.max_model_len),
            **s.engine_kwargs,
        }
        start = time.perf_counter()
        with (
            _environment("CUDA_VISIBLE_DEVICES", s.visible_devices),  # inherited by the engine's processes
            _environment("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if s.in_process else None),
        ):
            llm = LLM(**kwargs)
        log.info(
            "vLLM engine started in %.1f s (%s, max_model_len %d%s)",
            time.perf_counter() - start,
            s.precision,
            s.max_model_len,
            ", in this process" if s.in_process else "",
        )
        return llm

    def refit(self) -> None:
        """Loads the trainer's current weights into the engine (waking it first on a GPU)."""
        if self.model is None:
            raise RuntimeError("this engine has no trainer model beside it; its weights come by load_buckets")
        self.load_buckets(buckets(engine_state(self.model), self.dtype))

    def load_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Loads full tensors (checkpoint names, every one of the model's) into the engine.

        Every bucket is written to a safetensors file first (``buckets`` is consumed whole even when the
        engine then fails: it may be a collective's receiving end), then the engine's workers reload them
        all at once (``model_runner.reload_weights``, which redoes the CPU kernels' weight repacking).
        """
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        paths: list[str] = []
        written = 0
        try:
            prefix = f"rlfleet-refit-{os.getpid()}-{id(self):x}"
            for i, bucket in enumerate(buckets):
                path = os.path.join(_scratch_dir(), f"{prefix}-{i:05d}.safetensors")
                paths.append(path)
                save_file({k: v.to("cpu", self.dtype).contiguous() for k, v in bucket.items()}, path)
                written += len(bucket)
            loaded = self.llm.collective_rpc("reload_from_files", args=(paths,))
        finally:
            for path in paths:
                Path(path).unlink(missing_ok=True)
        if any(count != written for count in loaded):
            raise RuntimeError(f"vLLM refit loaded {loaded} tensors per worker, expected {written}")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prompt KV blocks were computed by the old weights
        self.has_weights = True

    def take_metrics(self) -> dict[str, float]:
        """One engine in this process: nothing per worker to report (the loop times the refit)."""
        return {}

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[GenerationResult]:
        return self.generate_rows(prompts, params, row_seeds(seed, len(prompts)))

    def generate_rows(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[GenerationResult]:
        """One response per prompt, row ``i`` sampled from ``seeds[i]`` alone, in the prompts' order."""
        from vllm import SamplingParams as EngineParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not self.has_weights:
            raise RuntimeError("the vLLM engine holds dummy weights: load_buckets must run before generating")
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        eos = self.tokenizer.eos_token_id
        requests = [
            EngineParams(
                n=1,
                seed=row_seed,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=params.top_p,
                top_k=-1 if params.top_k is None else params.top_k,
                max_tokens=params.max_new_tokens,
                logprobs=None if params.greedy else 0,  # 0: the sampled token's logprob only
                stop_token_ids=[eos],
                # stop strings need the text; the completing token is kept (token in, token out)
                stop=list(params.stop_strings) or None,
                include_stop_str_in_output=True,
                detokenize=bool(params.stop_strings),
            )
            for row_seed in seeds
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        if self.sleeps:
            self.llm.sleep(level=1)
            self.asleep = True
        return [self._result(out.outputs[0], params.greedy) for out in outputs]

    def _result(self, completion: Any, greedy: bool) -> GenerationResult:
        ids = tuple(completion.token_ids)
        if greedy:
            logprobs = (0.0,) * len(ids)
        else:
            steps = zip(completion.logprobs, ids, strict=True)
            logprobs = tuple(step[token].logprob for step, token in steps)
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string
        finished = completion.finish_reason == "stop"
        return GenerationResult(token_ids=ids, logprobs=logprobs, text=text, finished=finished)

    def close(self) -> None:
        """Stops the engine process and removes its own model directory; safe to call twice."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()
        if self.owns_model_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)
