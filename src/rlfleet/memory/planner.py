"""A recipe's memory on the machine that runs it: the estimate of ``rlfleet.memory_estimate`` for its
layout, compared with what the machine has, and the refusal ``validate`` and the run give before any
model is loaded when it does not fit.

On a CPU every process of the run shares the machine's memory: the training ranks (one process, or one
Ray actor per rank) and the generation engines (vLLM's engine process with its own weights and KV cache
space). On a GPU each training rank has its device. With ``RAY_ADDRESS`` set, or several nodes, the run
trains elsewhere and nothing here is compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlfleet.config.batching import Pass, micro_batch_rows, micro_batch_tokens
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.checks import Algorithm
from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.resolved import policy_precision
from rlfleet.config.schema import ArchitectureConfig, MasterConfig
from rlfleet.memory_estimate import (
    GIB,
    ModelState,
    PassShape,
    logprob_peak,
    train_peak,
)
from rlfleet.utils.allocator import running_allocator

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# a CPU vLLM engine process beside its weights and KV cache space (interpreter, torch, vLLM)
VLLM_CPU_PROCESS_BYTES = int(1.0 * GIB)
# a default token budget (packing, dynamic batching) may use this share of the memory left to one rank
BUDGET_HEADROOM = 0.7
# the share of the memory an estimate may reach before validate and the run refuse it: the estimate was
# within 12% of the measured peak on SmolLM2 (benchmarks/memory.py), and an underestimate meets the OOM killer
REFUSAL_SHARE = 0.9
# RLFLEET_MEMORY_CHECK=off runs a layout whose estimate exceeds the machine's memory (the estimate is within
# about 25% of the measured peak; a user who knows better may try)
SKIP_ENV = "RLFLEET_MEMORY_CHECK"


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated peak bytes of one training rank's passes and of the generation engines, and what the
    machine offers.

    Attributes:
        on_gpu: Training ranks run on GPUs (else CPU processes).
        passes: ``{"logprob": parts, "train": parts}``: bytes by part at each pass's peak, one rank.
        tokens: Tokens of each pass's micro-batch.
        ranks_here: Training ranks that share this machine's memory (CPU: all; GPU: one per device).
        generation: Bytes of the generation engines that share that memory (CPU vLLM engines), by part.
        available: Bytes this machine offers the run (CPU: MemAvailable; GPU: one device's memory), or
            None where it cannot be known here (a remote cluster, no CUDA for a GPU recipe).
        allocator: The ``malloc`` a CPU estimate is for (``glibc`` keeps part of what a backward frees).
    """

    on_gpu: bool
    passes: dict[str, dict[str, float]]
    tokens: dict[str, int]
    ranks_here: int
    generation: dict[str, float]
    available: int | None
    allocator: str

    def rank_peak(self) -> float:
        return max(sum(parts.values()) for parts in self.passes.values())

    def total(self) -> float:
        """The peak of everything that shares the memory ``available`` measures."""
        return self.ranks_here * self.rank_peak() + sum(self.generation.values())


def count_parameters(a: ArchitectureConfig) -> int:
    """Parameters of a Llama/Qwen/Gemma-style decoder (gated MLP, GQA attention, RMSNorm)."""
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    attention = a.hidden_size * head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
    mlp = 3 * a.hidden_size * a.intermediate_size
    norms = 2 * a.hidden_size
    embeddings = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return a.num_hidden_layers * (attention + mlp + norms) + embeddings + a.hidden_size


def count_lora_parameters(cfg: MasterConfig) -> int:
    """Adapter parameters ``policy.dtensor_cfg.lora_cfg`` adds to ``policy.architecture`` (Llama layout).

    Raises:
        LoraTargetError: A ``target_modules``/``exclude_modules`` pattern names no linear of that layout.
    """
    from rlfleet.models.lora import adapter_parameter_count, linear_shapes, lora_settings, select_targets

    a, settings = cfg.policy.architecture, lora_settings(cfg)
    if a is None or settings is None:
        raise ValueError("count_lora_parameters needs policy.architecture and lora_cfg.enabled=true")
    shapes = linear_shapes(
        hidden=a.hidden_size,
        heads=a.num_attention_heads,
        kv_heads=a.num_key_value_heads,
        head_dim=a.head_dim or a.hidden_size // a.num_attention_heads,
        intermediate=a.intermediate_size,
        layers=a.num_hidden_layers,
        vocab=a.vocab_size,
    )
    tied = {"lm_head"} if a.tie_word_embeddings else set()
    return adapter_parameter_count(shapes, select_targets(list(shapes), tied, settings), settings.dim)


def cpu_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``: what can be allocated without swapping (Linux only)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def trains_here(cfg: MasterConfig) -> bool:
    """Whether the run trains on this machine: no remote Ray cluster (``RAY_ADDRESS``) and one node."""
    return not os.environ.get("RAY_ADDRESS") and cfg.cluster.num_nodes == 1


def trains_on_gpu(cfg: MasterConfig) -> bool:
    """Whether the training ranks have GPUs: CUDA here when the run trains here; a cluster's recipe
    (several nodes, or ``RAY_ADDRESS``) is taken to be for GPUs."""
    if not trains_here(cfg):
        return True
    import torch

    return torch.cuda.is_available()


def _available(cfg: MasterConfig, on_gpu: bool) -> int | None:
    if not trains_here(cfg):
        return None
    if on_gpu:
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return cpu_available_bytes()


def pass_tokens(cfg: MasterConfig, pass_: Pass, algorithm: Algorithm = "grpo") -> int:
    """Tokens of a ``pass_`` micro-batch: the packing/dynamic budget (set, or ``default_budget``), else
    rows x sequence budget."""
    budget = default_budget(cfg, pass_, algorithm) or micro_batch_tokens(cfg.policy, pass_)
    if budget is not None:
        return budget
    return micro_batch_rows(cfg.policy, pass_) * cfg.policy.max_total_sequence_length


def check_enabled() -> bool:
    """False when ``RLFLEET_MEMORY_CHECK`` is off: no refusal, and budgets default as the recipe says."""
    return os.environ.get(SKIP_ENV, "").lower() not in ("0", "off", "false", "no")


def parameter_counts(cfg: MasterConfig) -> tuple[int, int]:
    """``(parameters, trainable parameters)`` of ``policy.architecture`` (LoRA: the adapters)."""
    arch = cfg.policy.architecture
    assert arch is not None
    parameters = count_parameters(arch)
    try:
        trainable = count_lora_parameters(cfg) if cfg.policy.dtensor_cfg.lora_cfg.enabled else parameters
    except ValueError:  # LoraTargetError: reported by the config checks
        trainable = parameters
    return parameters, trainable


def fitted_budgets(cfg: MasterConfig, algorithm: Algorithm = "grpo") -> dict[Pass, int]:
    """``default_budget`` of each pass where it applies."""
    passes: tuple[Pass, ...] = ("train",) if algorithm == "sft" else ("train", "logprob")
    found = {pass_: default_budget(cfg, pass_, algorithm) for pass_ in passes}
    return {pass_: n for pass_, n in found.items() if n is not None}


def explained_budgets(cfg: MasterConfig, algorithm: Algorithm = "grpo") -> dict[Pass, tuple[int, str]]:
    """``fitted_budgets`` with why each is what it is (``budget_basis``)."""
    return {pass_: (n, budget_basis(cfg, pass_, n)) for pass_, n in fitted_budgets(cfg, algorithm).items()}


def default_budget(cfg: MasterConfig, pass_: Pass, algorithm: Algorithm = "grpo") -> int | None:
    """The ``pass_`` token budget of packing or dynamic batching enabled without one: the largest that
    fits this machine with ``BUDGET_HEADROOM`` (``largest_fitting_tokens``), at most the tokens of a rank's
    whole share of the batch. None where the recipe's own default stands (``max_total_sequence_length x``
    the rows): a budget set, neither enabled, no ``policy.architecture``, a run that trains elsewhere, the
    check off, or not even one sequence fitting (the run is then refused with the estimate)."""
    p = cfg.policy
    section = next((s for s in (p.sequence_packing, p.dynamic_batching) if s.enabled), None)
    if section is None or p.architecture is None or not check_enabled() or not trains_here(cfg):
        return None
    if (section.train_mb_tokens if pass_ == "train" else section.logprob_mb_tokens) is not None:
        return None
    layout = resource_layout(cfg)
    best = largest_fitting_tokens(cfg, layout, *parameter_counts(cfg), pass_, algorithm)
    if best is None or best < p.max_total_sequence_length:
        return None
    return min(best, whole_share_tokens(cfg, layout, pass_))


def whole_share_tokens(cfg: MasterConfig, layout: ResourceLayout, pass_: Pass) -> int:
    """Tokens of one training rank's whole share of a ``pass_``'s rows at the sequence budget (at least one
    sequence): no budget larger than that can fill a micro-batch."""
    p = cfg.policy
    rows = (
        p.train_global_batch_size
        if pass_ == "train"
        else cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    )
    return max(-(-rows // layout.train_world), 1) * p.max_total_sequence_length


def budget_basis(cfg: MasterConfig, pass_: Pass, tokens: int) -> str:
    """Why ``default_budget`` chose ``tokens``: the whole share of the batch (a micro-batch can hold no
    more, and it fits), or the largest that fits this machine with headroom."""
    if tokens >= whole_share_tokens(cfg, resource_layout(cfg), pass_):
        return "a rank's whole share of the batch, which fits this machine's memory"
    return "the largest that fits this machine's memory with headroom"


def model_state(
    cfg: MasterConfig, layout: ResourceLayout, parameters: int, trainable: int, algorithm: Algorithm = "grpo"
) -> ModelState:
    """The state bytes one training rank holds (FSDP shards it over the training ranks)."""
    compute = BYTES[policy_precision(cfg).name]
    sharded = uses_ray(cfg, layout=layout)
    world = layout.train_world if sharded else 1
    layers = cfg.policy.architecture.num_hidden_layers if cfg.policy.architecture else 1
    reference = (
        algorithm == "grpo"
        and cfg.loss_fn.reference_policy_kl_penalty > 0
        and not cfg.policy.dtensor_cfg.lora_cfg.enabled
    )
    if compute == 4:
        copies = 0.0
    elif sharded:  # FSDP2 all-gathers one layer in the compute dtype, and prefetches the next
        copies = 2 * compute * parameters / layers
    else:  # autocast caches every weight's cast for the forward and backward
        copies = compute * parameters
    return ModelState(
        weights=4 * parameters / world,
        optimizer=8 * trainable / world,
        gradients=4 * trainable / world,
        reference=compute * parameters / world if reference else 0.0,
        compute_copies=copies,
    )


def _shape(cfg: MasterConfig, layout: ResourceLayout, pass_: Pass, tokens: int | None = None) -> PassShape:
    p = cfg.policy
    tokens = tokens if tokens is not None else pass_tokens(cfg, pass_)
    return PassShape(
        tokens=tokens,
        logit_tokens=min(tokens, p.logprob_chunk_size or tokens),
        compute_bytes=BYTES[policy_precision(cfg).name],
        checkpointing=p.dtensor_cfg.activation_checkpointing,
        tensor_parallel=layout.train_tp,
    )


def _generation(cfg: MasterConfig, layout: ResourceLayout, parameters: int, on_gpu: bool) -> dict[str, float]:
    """CPU vLLM engine processes (weights, KV cache space, process); nothing where generation has its
    own GPUs or shares the policy's weights in process."""
    if on_gpu or layout.backend != "vllm":
        return {}
    v = cfg.policy.generation.vllm_cfg
    dtype = v.precision or policy_precision(cfg).name
    from rlfleet.generation.vllm import CPU_KV_CACHE_GIB

    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB) * GIB
    engines = layout.gen_engines
    return {
        f"vLLM weights ({dtype})": engines * BYTES[dtype] * parameters,
        "vLLM KV cache space": engines * kv,
        "vLLM processes": engines * VLLM_CPU_PROCESS_BYTES,
    }


def memory_plan(
    cfg: MasterConfig,
    layout: ResourceLayout,
    parameters: int,
    trainable: int,
    *,
    tokens: dict[str, int] | None = None,
    algorithm: Algorithm = "grpo",
    allocator: str | None = None,
) -> MemoryPlan:
    """The estimate for ``cfg`` running ``algorithm`` on this machine (``tokens`` overrides each pass's
    micro-batch tokens; SFT has no logprob pass) with this process's ``malloc`` (or ``allocator``:
    ``glibc`` or ``jemalloc``; the ``rlfleet`` command line runs on jemalloc where it is installed)."""
    on_gpu = trains_on_gpu(cfg)
    allocator = allocator or running_allocator()
    arch = cfg.policy.architecture
    assert arch is not None, "memory_plan needs policy.architecture"
    state = model_state(cfg, layout, parameters, trainable, algorithm)
    sizes = {
        pass_: (tokens or {}).get(pass_) or pass_tokens(cfg, pass_, algorithm)
        for pass_ in ("logprob", "train")
    }
    passes = {
        "logprob": logprob_peak(
            arch, state, _shape(cfg, layout, "logprob", sizes["logprob"]), cpu=not on_gpu
        ),
        "train": train_peak(
            arch,
            state,
            _shape(cfg, layout, "train", sizes["train"]),
            cpu=not on_gpu,
            allocator=allocator,
        ),
    }
    if algorithm == "sft":
        del passes["logprob"], sizes["logprob"]
    return MemoryPlan(
        on_gpu=on_gpu,
        passes=passes,
        tokens=sizes,
        ranks_here=1 if on_gpu else layout.train_world,
        generation=_generation(cfg, layout, parameters, on_gpu),
        available=_available(cfg, on_gpu),
        allocator=allocator,
    )


def largest_fitting_tokens(
    cfg: MasterConfig,
    layout: ResourceLayout,
    parameters: int,
    trainable: int,
    pass_: Pass,
    algorithm: Algorithm = "grpo",
) -> int | None:
    """The largest ``pass_`` micro-batch token budget (a multiple of 256) with which that pass's ranks and
    generation stay within ``BUDGET_HEADROOM`` of the available memory, or None when not even 256 tokens
    fit or nothing is known of the machine."""

    def fits(n: int) -> bool:
        plan = memory_plan(
            cfg, layout, parameters, trainable, tokens={"train": n, "logprob": n}, algorithm=algorithm
        )
        peak = plan.ranks_here * sum(plan.passes[pass_].values()) + sum(plan.generation.values())
        return plan.available is not None and peak <= BUDGET_HEADROOM * plan.available

    if not fits(256):
        return None
    low, high = 1, 1
    while fits(256 * high * 2) and high < 2**16:
        high *= 2
    low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(256 * mid) else (low, mid)
    return 256 * low


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _fixes(
    cfg: MasterConfig, layout: ResourceLayout, parameters: int, trainable: int, algorithm: Algorithm
) -> list[str]:
    p, fixes = cfg.policy, []
    section = next(
        (name for name in ("sequence_packing", "dynamic_batching") if getattr(p, name).enabled), None
    )
    passes: tuple[tuple[Pass, str], ...] = (("train", "train_mb_tokens"), ("logprob", "logprob_mb_tokens"))
    for pass_, key in passes[: 1 if algorithm == "sft" else 2]:
        best = largest_fitting_tokens(cfg, layout, parameters, trainable, pass_, algorithm)
        if best is not None and best < pass_tokens(cfg, pass_, algorithm):
            if section is not None:
                fixes.append(f"policy.{section}.{key}={best}")
            else:
                rows = "train_micro_batch_size" if pass_ == "train" else "logprob_batch_size"
                fixes.append(f"policy.{rows}={max(best // p.max_total_sequence_length, 1)}")
    if not p.dtensor_cfg.activation_checkpointing:
        fixes.append("policy.dtensor_cfg.activation_checkpointing=true")
    if p.logprob_chunk_size is None:
        fixes.append("policy.logprob_chunk_size=512")
    return fixes


def memory_problems(
    cfg: MasterConfig, layout: ResourceLayout | None = None, algorithm: Algorithm = "grpo"
) -> list[str]:
    """One line per way ``cfg``'s estimated peak exceeds this machine's memory (none when the recipe has
    no ``policy.architecture`` or the machine's memory cannot be known here)."""
    if cfg.policy.architecture is None or not check_enabled():
        return []
    layout = layout if layout is not None else resource_layout(cfg)
    parameters, trainable = parameter_counts(cfg)
    plan = memory_plan(cfg, layout, parameters, trainable, algorithm=algorithm)
    if plan.available is None or plan.total() <= REFUSAL_SHARE * plan.available:
        return []
    where = "one GPU" if plan.on_gpu else "this machine"
    worst = max(plan.passes, key=lambda k: sum(plan.passes[k].values()))
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.passes[worst].items())
    fixes = _fixes(cfg, layout, parameters, trainable, algorithm)
    return [
        f"memory: the estimated peak, {_gib(plan.total())}, exceeds {round(100 * REFUSAL_SHARE)}% of the "
        f"{_gib(plan.available)} available on {where} ({worst} pass of {plan.tokens[worst]:,} tokens per "
        f"micro-batch: {parts}"
        + (f"; x {plan.ranks_here} ranks" if plan.ranks_here > 1 else "")
        + (f"; generation {_gib(sum(plan.generation.values()))}" if plan.generation else "")
        + f"); fix: {' and/or '.join(fixes)} (or {SKIP_ENV}=off to try anyway)"
    ]


def ensure_fits(
    cfg: MasterConfig, layout: ResourceLayout | None = None, algorithm: Algorithm = "grpo"
) -> None:
    """Raises ``ConfigError`` when ``cfg``'s estimated peak memory exceeds what this machine has."""
    problems = memory_problems(cfg, layout, algorithm)
    if problems:
        raise ConfigError(
            problems, header="the run would not fit in memory (rlfleet plan shows the estimate):"
        )
