"""Building a run's components from the config: the policy and its generation backend, the prompts, the
micro-batching of its passes.

Each builder reads the config and hands the component explicit arguments; the loops call these and then
wire the results together (see :mod:`rlfleet.runtime.loop`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rlfleet.config import MasterConfig
from rlfleet.config.backends import backend_of
from rlfleet.config.batching import Pass, ResolvedBatching, budget_key, micro_batch_rows
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.resolved import BackendName, generation_backend, policy_precision
from rlfleet.data import (
    Example,
    Prompt,
    build_prompts,
    load_prompt_template,
    load_task,
    resolve_system_prompt,
)
from rlfleet.generation import (
    GenerationBackend,
    HFGenerationBackend,
    NoGeneration,
    VLLMGenerationBackend,
    VLLMSettings,
)
from rlfleet.models.loading import ModelSource
from rlfleet.models.lora import lora_settings
from rlfleet.policy.interface import Policy
from rlfleet.policy.microbatch import MicroBatching
from rlfleet.policy.rank import OptimizerSettings, PolicyRank
from rlfleet.policy.schedule import LrSchedule
from rlfleet.policy.sharded_rank import ShardingSettings
from rlfleet.utils.flops import FlopMeter, peak_flops, shape_from_config

log = logging.getLogger("rlfleet")


def model_source(cfg: MasterConfig) -> ModelSource:
    """Where every worker loads the policy from."""
    policy = cfg.policy
    precision = policy_precision(cfg).name
    rm = policy.reward_model_cfg
    return ModelSource(
        policy.model_name,
        precision,
        policy.gguf_file,
        policy.tokenizer.name,
        reward_model=rm.reward_model_type if rm.enabled else None,
        chat_template=policy.tokenizer.chat_template,
    )


def optimizer_settings(cfg: MasterConfig) -> OptimizerSettings:
    policy = cfg.policy
    adamw, sched = policy.optimizer.kwargs, policy.scheduler
    return OptimizerSettings(
        lr=adamw.lr,
        weight_decay=adamw.weight_decay,
        betas=adamw.betas,
        eps=adamw.eps,
        max_grad_norm=policy.max_grad_norm,
        foreach=adamw.foreach,
        fused=adamw.fused,
        schedule=LrSchedule(
            warmup_steps=sched.warmup_steps,
            warmup_start_factor=sched.warmup_start_factor,
            decay=sched.decay,
            decay_steps=sched.decay_steps,
            min_factor=sched.min_lr_factor,
        ),
    )


def build_worker(cfg: MasterConfig, *, seed: int, keep_reference: bool) -> PolicyRank:
    """Loads the policy named by ``policy.model_name`` into an in-process worker with its optimizer."""
    settings = optimizer_settings(cfg)
    torch.manual_seed(seed)
    # float32 master weights computing in policy.precision; on the GPU when there is one (the Ray layer
    # places multi-GPU workers)
    return PolicyRank(
        model_source(cfg),
        settings,
        keep_reference=keep_reference,
        activation_checkpointing=cfg.policy.dtensor_cfg.activation_checkpointing,
        lora=lora_settings(cfg),
        torch_compile=cfg.policy.torch_compile,
    )


def vllm_settings(cfg: MasterConfig, seed: int) -> VLLMSettings:
    """The vLLM engine's settings: ``policy.generation.vllm_cfg`` with its nulls resolved."""
    policy = cfg.policy
    vllm = policy.generation.vllm_cfg
    return VLLMSettings(
        precision=vllm.precision or policy_precision(cfg).name,
        max_model_len=vllm.max_model_len or policy.max_total_sequence_length,
        seed=seed,
        enforce_eager=vllm.enforce_eager,
        load_format=vllm.load_format,
        gpu_memory_utilization=vllm.gpu_memory_utilization,
        tensor_parallel_size=vllm.tensor_parallel_size,
        engine_kwargs=dict(vllm.vllm_kwargs),
    )


def ray_vllm_settings(cfg: MasterConfig, seed: int) -> VLLMSettings:
    """The settings of a vLLM engine hosted by a Ray actor: a tensor-parallel engine runs its workers as
    its own processes on the actor's GPUs (inside a placement group vLLM would otherwise pick its Ray
    executor and ask Ray for GPUs the actor already holds)."""
    settings = vllm_settings(cfg, seed)
    if settings.tensor_parallel_size == 1:
        return settings
    kwargs = {"distributed_executor_backend": "mp", **settings.engine_kwargs}
    return replace(settings, engine_kwargs=kwargs)


def _hf_backend(cfg: MasterConfig, worker: PolicyRank, seed: int) -> GenerationBackend:
    return HFGenerationBackend(
        worker.model,
        worker.tokenizer,
        cfg.policy.generation.batch_size,
        compute_dtype=worker.autocast_dtype,
    )


def _vllm_backend(cfg: MasterConfig, worker: PolicyRank, seed: int) -> GenerationBackend:
    engine = VLLMGenerationBackend(worker.model, worker.tokenizer, vllm_settings(cfg, seed))
    worker.closers.append(engine.close)  # closed with the worker, which the loops already close
    return engine


# the class behind each backend name (what each can do: rlfleet.config.backends)
IN_PROCESS_BACKENDS: dict[BackendName, Callable[[MasterConfig, PolicyRank, int], GenerationBackend]] = {
    "hf": _hf_backend,
    "vllm": _vllm_backend,
}


def build_backend(cfg: MasterConfig, worker: PolicyRank, *, seed: int) -> GenerationBackend:
    """The configured generation backend, colocated with ``worker`` (an engine of its own is closed with the
    worker: ``worker.close()``)."""
    return IN_PROCESS_BACKENDS[generation_backend(cfg).name](cfg, worker, seed)


def build_policy(
    cfg: MasterConfig, layout: ResourceLayout, *, seed: int, keep_reference: bool, generation: bool = True
) -> tuple[Policy, GenerationBackend]:
    """The policy and its generation backend: in this process, or on Ray when ``layout`` asks for it.
    Without ``generation`` (a reward model samples nothing) no engine is built: ``NoGeneration``.

    The caller owns what this starts: ``policy.close()`` stops the Ray actors (a no-op in-process).
    """
    resolved = generation_backend(cfg)
    if generation and resolved.reason != "set by the recipe":
        log.info("generation: %s (%s)", resolved.name, resolved.reason)
    if not uses_ray(cfg, layout=layout):
        worker = build_worker(cfg, seed=seed, keep_reference=keep_reference)
        return worker, build_backend(cfg, worker, seed=seed) if generation else NoGeneration()
    from rlfleet.distributed.ray_generation import RayGeneration  # the ray extra
    from rlfleet.distributed.ray_policy import RayPolicy, RayRuntime

    policy_cfg, cluster = cfg.policy, cfg.cluster
    source = model_source(cfg)
    runtime = RayRuntime(
        layout,
        source,
        optimizer_settings(cfg),
        ShardingSettings(
            policy_cfg.dtensor_cfg.tensor_parallel_size,
            policy_cfg.dtensor_cfg.activation_checkpointing,
            lora=lora_settings(cfg),
        ),
        generation_batch_size=policy_cfg.generation.batch_size,
        vllm=ray_vllm_settings(cfg, seed) if generation and backend_of(layout).reads_vllm_cfg else None,
        keep_reference=keep_reference,
        seed=seed,
        call_timeout_s=cluster.call_timeout_s,
        placement_timeout_s=cluster.placement_timeout_s,
        generation=generation,
    )
    try:
        backend = RayGeneration(runtime, cluster.generation_retries) if generation else NoGeneration()
        return RayPolicy(runtime, source.load_tokenizer(), keep_reference), backend
    except BaseException:
        runtime.close()
        raise


def prompt_budget(cfg: MasterConfig) -> int:
    """Longest prompt (tokens) that still leaves room for ``max_new_tokens`` in the sequence limit."""
    limit = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    return min(limit, cfg.data.max_input_seq_length or limit)


@dataclass
class TaskData:
    train: list[Prompt]
    val: list[Prompt]
    dropped: int


TaskExamples = tuple[list[Example], list[Example]]  # (train, val), as ``load_task`` returns them


def load_prompts(
    cfg: MasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_val_samples: int,
    examples: TaskExamples | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> TaskData:
    """Renders the task's prompts; too-long prompts are dropped and counted. ``tools`` (an environment's tool
    schemas) are rendered into each prompt by the chat template, where it supports them.

    ``examples`` are the task's rows when already read (``load_task(cfg.data)``, which checks every row, is
    cheap and runs before any model loads); None reads them here.
    """
    train_ex, val_ex = examples if examples is not None else load_task(cfg.data)
    system_prompt = resolve_system_prompt(cfg.data)
    template = load_prompt_template(cfg.data)
    budget = prompt_budget(cfg)
    render = functools.partial(
        build_prompts,
        tokenizer,
        system_prompt=system_prompt,
        max_prompt_tokens=budget,
        prompt_template=template,
        tools=tools,
    )
    train, dropped_train = render(train_ex)
    val, dropped_val = render(val_ex[:max_val_samples])
    if dropped_train or dropped_val:
        log.warning(
            "dropped %d train and %d val prompts longer than %d tokens", dropped_train, dropped_val, budget
        )
    return TaskData(train=train, val=val, dropped=dropped_train + dropped_val)


def micro_batching(cfg: MasterConfig, pass_: Pass, batching: ResolvedBatching) -> MicroBatching:
    """How ``pass_`` (training or logprobs) splits its rows: by the token budget ``batching`` resolved for it
    (``rlfleet.memory.planner.resolve_batching``: packed sequences or dynamic batching), else fixed rows
    (``train_micro_batch_size`` / ``logprob_batch_size``). A budget fitted to this machine is logged."""
    policy = cfg.policy
    rows, chunk = micro_batch_rows(policy, pass_), policy.logprob_chunk_size
    if batching.section is None:
        return MicroBatching(rows, logprob_chunk=chunk)
    budget = batching.budget(pass_)
    if budget.fitted:
        log.info(
            "policy.%s.%s=%d: %s (rlfleet plan; set it to fix it)",
            batching.section,
            budget_key(pass_),
            budget.tokens,
            budget.why,
        )
    if batching.section == "sequence_packing":
        return MicroBatching(
            rows, budget.tokens, pack=True, algorithm=policy.sequence_packing.algorithm, logprob_chunk=chunk
        )
    return MicroBatching(
        rows, budget.tokens, round_to=policy.dynamic_batching.sequence_length_round, logprob_chunk=chunk
    )


def flop_meter(cfg: MasterConfig, policy: Policy, layout: ResourceLayout | None = None) -> FlopMeter | None:
    """The MFU meter of a run on GPUs whose peak is known (None on CPUs: no meaningful peak)."""
    peak = peak_flops(policy.accelerator_name(), 32 if policy_precision(cfg).name == "float32" else 16)
    if peak is None:
        return None
    with torch.device("meta"):  # the shape only: no memory, no weights read
        model = AutoModelForCausalLM.from_config(model_source(cfg).load_config())
    world = (layout or resource_layout(cfg)).train_world
    return FlopMeter(shape_from_config(model), peak, world)
