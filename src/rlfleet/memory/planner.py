"""A recipe's memory on the machine that runs it: the estimate of ``rlfleet.memory.estimate`` for its
layout, compared with what the machine has; the token budgets the run uses (``resolve_batching``: the
recipe's, or where it leaves one unset the largest that fits); and the refusal ``validate`` and the run give
before any model is loaded when it does not fit (``ensure_fits``).

On a CPU every process of the run shares the machine's memory: the training ranks (one process, or one
Ray actor per rank) and the generation engines (vLLM's engine process with its own weights and KV cache
space). On a GPU each training rank has its device. With ``RAY_ADDRESS`` set, or several nodes, the run
trains elsewhere and nothing here is compared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rlfleet.config.algorithm import Algorithm, AlgorithmSettings, algorithm_settings
from rlfleet.config.backends import backend_of
from rlfleet.config.batching import (
    PASSES,
    Pass,
    ResolvedBatching,
    TokenBudget,
    budget_key,
    recipe_budget,
    set_budget,
    token_budget_section,
)
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.resolved import policy_precision, teacher_precision
from rlfleet.config.schema import ArchitectureConfig, MasterConfig
from rlfleet.memory.allocator import running_allocator
from rlfleet.memory.estimate import (
    CPU_PROCESS_BYTES,
    GIB,
    ModelState,
    PassShape,
    gib,
    logprob_peak,
    train_peak,
)

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes of optimizer state per trained parameter, for each policy.optimizer.name the schema admits: AdamW's
# two float32 moments (m and v)
OPTIMIZER_STATE_BYTES = {"torch.optim.AdamW": 8, "AdamW": 8}
# A CPU vLLM engine beside its weights and KV cache space, measured on a tiny model, SmolLM2-135M and Gemma 3
# 270M (bf16, 1 GiB of KV cache space, 64 samples of 256 tokens; anonymous resident memory of each process):
# its worker process holds the interpreter, torch and vLLM (0.46 GiB on the tiny model) and, per weight, about
# two more bf16 copies (its CPU GEMM dispatch keeps a oneDNN-packed copy of each linear layer beside the
# weight: 0.42 GiB beyond SmolLM2's 0.25 GiB of weights, 0.98 beyond Gemma's 0.50); its engine core process
# 0.40 GiB and its tokenizer (0.45 GiB with SmolLM2's 49,152 entries, 0.73 with Gemma's 262,144); the client
# in the trainer process imports vLLM (0.25 GiB: 0.39 against torch's 0.14).
VLLM_CPU_WORKER_BYTES = int(0.45 * GIB)
VLLM_CPU_PACKED_WEIGHT_COPIES = 2
VLLM_CPU_CORE_BYTES = int(0.40 * GIB)
VLLM_CPU_CORE_BYTES_PER_VOCAB_ENTRY = 1300
VLLM_CLIENT_BYTES = int(0.25 * GIB)
# one worker process of an environment's pool, and its forkserver: 0.19 GiB each, measured for the math
# environment (its verifier's imports) in a GRPO run of Gemma 3
ENV_WORKER_BYTES = int(0.19 * GIB)
# a fitted token budget (packing, dynamic batching) may use this share of the memory left to one rank
BUDGET_HEADROOM = 0.7
# the share of the memory an estimate may reach before validate and the run refuse it: the estimate is close
# to the measured peak (benchmarks/memory.py compares them), and an underestimate meets the OOM killer
REFUSAL_SHARE = 0.9
# RLFLEET_MEMORY_CHECK=off runs a layout whose estimate exceeds the machine's memory (the estimate is not
# exact; a user who knows better may try)
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


def algorithm_passes(run: AlgorithmSettings) -> tuple[Pass, ...]:
    """The passes an algorithm runs: SFT and reward models have no logprob pass (distillation's is the
    teacher's top-k pass)."""
    return PASSES if run.logprob_rows is not None else ("train",)


def count_parameters(a: ArchitectureConfig) -> int:
    """Parameters of a Llama/Qwen/Gemma-style decoder (gated MLP, GQA attention, RMSNorm), and what the
    model loads beside it (``other_parameters``: a vision tower)."""
    head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    attention = a.hidden_size * head_dim * (2 * a.num_attention_heads + 2 * a.num_key_value_heads)
    mlp = 3 * a.hidden_size * a.intermediate_size
    norms = 2 * a.hidden_size
    layers = a.num_hidden_layers * (attention + mlp + norms)
    return layers + unsplit_parameters(a) + a.other_parameters


def unsplit_parameters(a: ArchitectureConfig) -> int:
    """The decoder's parameters outside its layers, which tensor parallelism leaves whole on every rank:
    the embeddings (and an untied output layer) and the final norm."""
    return a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2) + a.hidden_size


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


def switched_off(variable: str) -> bool:
    """Whether the environment variable reads off (``0``, ``off``, ``false``, ``no``)."""
    return os.environ.get(variable, "").lower() in ("0", "off", "false", "no")


def check_enabled() -> bool:
    """False when ``RLFLEET_MEMORY_CHECK`` is off: no refusal, and unset budgets take the recipe's default."""
    return not switched_off(SKIP_ENV)


def parameter_counts(cfg: MasterConfig) -> tuple[int, int]:
    """``(parameters, trainable parameters)`` of ``policy.architecture`` (LoRA: the adapters)."""
    arch = cfg.policy.architecture
    assert arch is not None
    parameters = count_parameters(arch)
    text = parameters - arch.other_parameters  # a vision tower gets no gradient from text
    try:
        trainable = count_lora_parameters(cfg) if cfg.policy.dtensor_cfg.lora_cfg.enabled else text
    except ValueError:  # LoraTargetError: reported by the config checks
        trainable = text
    return parameters, trainable


def resolve_batching(
    cfg: MasterConfig, layout: ResourceLayout | None = None, algorithm: Algorithm = "grpo"
) -> ResolvedBatching:
    """The token budget of each pass ``algorithm`` runs, resolved once before the run is built (the
    builders, ``ensure_fits``, ``plan`` and ``validate`` read it): under the enabled section
    (``token_budget_section``), the recipe's budget where it sets one, else the largest that fits this
    machine (``fitted_budget``), else the recipe's default (``max_total_sequence_length x`` the rows)."""
    section = token_budget_section(cfg.policy)
    if section is None:
        return ResolvedBatching(None)
    layout = layout if layout is not None else resource_layout(cfg)
    budgets = {}
    for pass_ in algorithm_passes(algorithm_settings(cfg, algorithm)):
        fitted = None
        if set_budget(cfg.policy, section, pass_) is None:
            fitted = fitted_budget(cfg, layout, pass_, algorithm)
        budgets[pass_] = fitted or recipe_budget(cfg.policy, section, pass_)
    return ResolvedBatching(section, budgets)


def fitted_budget(
    cfg: MasterConfig, layout: ResourceLayout, pass_: Pass, algorithm: Algorithm = "grpo"
) -> TokenBudget | None:
    """The ``pass_`` token budget for a recipe that leaves it unset: the largest that fits this machine with
    ``BUDGET_HEADROOM`` (``largest_fitting_tokens``), at most the tokens of a rank's whole share of the
    batch, with why (``budget_basis``). None where the recipe's own default stands: no
    ``policy.architecture``, a run that trains elsewhere, the check off, or not even one sequence fitting
    (the run is then refused with the estimate)."""
    p = cfg.policy
    if p.architecture is None or not check_enabled() or not trains_here(cfg):
        return None
    best = largest_fitting_tokens(cfg, layout, *parameter_counts(cfg), pass_, algorithm)
    if best is None or best < p.max_total_sequence_length:
        return None
    tokens = min(best, whole_share_tokens(cfg, layout, pass_, algorithm))
    return TokenBudget(tokens, budget_basis(cfg, layout, pass_, tokens, algorithm), fitted=True)


def whole_share_tokens(cfg: MasterConfig, layout: ResourceLayout, pass_: Pass, algorithm: Algorithm) -> int:
    """Tokens of one training rank's whole share of a ``pass_``'s rows at the sequence budget (at least one
    sequence): no budget larger than that can fill a micro-batch. The rows are ``algorithm``'s: an optimizer
    step's for the training pass, the step's scored sequences for the logprob pass."""
    run = algorithm_settings(cfg, algorithm)
    rows = run.update_rows if pass_ == "train" else run.logprob_rows
    if rows is None:
        raise ValueError(f"{algorithm} has no {pass_} pass")
    return max(-(-rows // layout.train_world), 1) * cfg.policy.max_total_sequence_length


def budget_basis(
    cfg: MasterConfig, layout: ResourceLayout, pass_: Pass, tokens: int, algorithm: Algorithm
) -> str:
    """Why ``fitted_budget`` chose ``tokens``: the whole share of the batch (a micro-batch can hold no
    more, and it fits), or the largest that fits this machine with headroom."""
    if tokens >= whole_share_tokens(cfg, layout, pass_, algorithm):
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
    run = algorithm_settings(cfg, algorithm)
    # LoRA's reference is the policy with its adapters off: no second copy
    reference = run.keeps_reference and not cfg.policy.dtensor_cfg.lora_cfg.enabled
    if compute == 4:
        copies = 0.0
    elif sharded:  # FSDP2 all-gathers one layer in the compute dtype, and prefetches the next
        copies = 2 * compute * parameters / layers
    else:  # autocast caches every weight's cast for the forward and backward
        copies = compute * parameters
    # tensor parallelism splits the decoder layers; what it leaves whole is sharded over data parallel only
    arch, tp = cfg.policy.architecture, layout.train_tp if sharded else 1
    whole = unsplit_parameters(arch) + arch.other_parameters if arch is not None and tp > 1 else 0
    trained_whole = 0 if cfg.policy.dtensor_cfg.lora_cfg.enabled else max(whole - _other(cfg), 0)

    def per_rank(count: float, held_whole: float) -> float:
        return (count - held_whole) / world + held_whole / max(world // tp, 1)

    held, trained = per_rank(parameters, whole), per_rank(trainable, trained_whole)
    return ModelState(
        weights=4 * held,
        optimizer=OPTIMIZER_STATE_BYTES[cfg.policy.optimizer.name] * trained,
        gradients=4 * trained,
        # in one process the reference computes as the policy does, from float32 weights under autocast
        reference=(compute if sharded else 4) * held if reference else 0.0,
        compute_copies=copies,
        # one process: the teacher beside the student; on Ray it is an actor of its own (``_teacher_actor``)
        teacher=teacher_bytes(cfg) if run.has_teacher and not sharded else 0.0,
    )


def _other(cfg: MasterConfig) -> int:
    arch = cfg.policy.architecture
    return arch.other_parameters if arch is not None else 0


def _teacher_actor(
    cfg: MasterConfig, layout: ResourceLayout, on_gpu: bool, run: AlgorithmSettings
) -> dict[str, float]:
    """A Ray run's distillation teacher: its actor's weights and process on this machine's CPU memory
    (nothing on a GPU cluster, where it holds a GPU of its own)."""
    if not run.has_teacher or on_gpu or not uses_ray(cfg, layout=layout):
        return {}
    return {"teacher actor weights": teacher_bytes(cfg), "teacher actor process": CPU_PROCESS_BYTES}


def teacher_bytes(cfg: MasterConfig) -> float:
    """The distillation teacher's weights (``teacher.architecture``, in ``teacher.precision``), held whole
    beside the student; 0 when the recipe gives no architecture for it."""
    if cfg.teacher is None or cfg.teacher.architecture is None:
        return 0.0
    return BYTES[teacher_precision(cfg).name] * count_parameters(cfg.teacher.architecture)


def _shape(cfg: MasterConfig, layout: ResourceLayout, tokens: int) -> PassShape:
    p = cfg.policy
    return PassShape(
        tokens=tokens,
        logit_tokens=min(tokens, p.logprob_chunk_size or tokens),
        compute_bytes=BYTES[policy_precision(cfg).name],
        checkpointing=p.dtensor_cfg.activation_checkpointing,
        tensor_parallel=layout.train_tp,
    )


def _generation(cfg: MasterConfig, layout: ResourceLayout, parameters: int, on_gpu: bool) -> dict[str, float]:
    """CPU engine processes of a backend with memory of its own (weights, KV cache space, process);
    nothing where generation has its own GPUs or shares the policy's weights in process."""
    backend = backend_of(layout)
    if on_gpu or not backend.own_memory:
        return {}
    dtype = generation_precision(cfg, layout)
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or backend.cpu_kv_cache_gib) * GIB
    engines, name = layout.gen_engines, backend.display_name
    weights = BYTES[dtype] * parameters
    vocab = cfg.policy.architecture.vocab_size if cfg.policy.architecture else 0
    return {
        f"{name} weights ({dtype})": engines * weights,
        f"{name} KV cache space": engines * kv,
        f"{name} worker (+ packed weights)": engines
        * (VLLM_CPU_WORKER_BYTES + VLLM_CPU_PACKED_WEIGHT_COPIES * weights),
        f"{name} engine core": engines * (VLLM_CPU_CORE_BYTES + VLLM_CPU_CORE_BYTES_PER_VOCAB_ENTRY * vocab),
        f"{name} client": VLLM_CLIENT_BYTES,
    }


def _environment_workers(cfg: MasterConfig, on_gpu: bool, run: AlgorithmSettings) -> dict[str, float]:
    """The worker processes of the recipe's default environment (``data.env_name``) and their forkserver, on
    this machine's CPU memory (none for a run that samples nothing, a reward model's, or on a GPU's)."""
    if on_gpu or not run.samples:
        return {}
    name = cfg.data.env_name
    section = cfg.env.custom().get(name) or getattr(cfg.env, name, None)
    workers = int(getattr(section, "num_workers", 0) or 0)
    if workers <= 0:
        return {}
    return {f"{name} environment workers ({workers} + forkserver)": (workers + 1) * ENV_WORKER_BYTES}


def generation_precision(cfg: MasterConfig, layout: ResourceLayout) -> str:
    """The dtype of the generation weights: ``vllm_cfg.precision`` for a backend it configures, else (or
    when null) the policy's."""
    precision = cfg.policy.generation.vllm_cfg.precision if backend_of(layout).reads_vllm_cfg else None
    return precision or policy_precision(cfg).name


def memory_plan(
    cfg: MasterConfig,
    layout: ResourceLayout,
    parameters: int,
    trainable: int,
    *,
    tokens: Mapping[str, int] | None = None,
    algorithm: Algorithm = "grpo",
    allocator: str | None = None,
) -> MemoryPlan:
    """The estimate for ``cfg`` running ``algorithm`` on this machine with each pass's micro-batch
    ``tokens`` (by default those of ``resolve_batching``; SFT has no logprob pass) and this process's
    ``malloc`` (or ``allocator``: ``glibc`` or ``jemalloc``; the ``rlfleet`` command line runs on jemalloc
    where it is installed)."""
    on_gpu = trains_on_gpu(cfg)
    allocator = allocator or running_allocator()
    arch = cfg.policy.architecture
    assert arch is not None, "memory_plan needs policy.architecture"
    run = algorithm_settings(cfg, algorithm)
    state = model_state(cfg, layout, parameters, trainable, algorithm)
    if tokens is None:
        tokens = pass_tokens(cfg, resolve_batching(cfg, layout, algorithm))
    sizes = {pass_: tokens[pass_] for pass_ in ("logprob", "train")}
    passes = {
        "logprob": logprob_peak(arch, state, _shape(cfg, layout, sizes["logprob"]), cpu=not on_gpu),
        "train": train_peak(
            arch,
            state,
            _shape(cfg, layout, sizes["train"]),
            cpu=not on_gpu,
            allocator=allocator,
            trains_output_layer=trainable == parameters,  # LoRA freezes it
        ),
    }
    if "logprob" not in algorithm_passes(run):
        del passes["logprob"], sizes["logprob"]
    return MemoryPlan(
        on_gpu=on_gpu,
        passes=passes,
        tokens=sizes,
        ranks_here=1 if on_gpu else layout.train_world,
        generation={
            **(_generation(cfg, layout, parameters, on_gpu) if run.samples else {}),
            **_teacher_actor(cfg, layout, on_gpu, run),
            **_environment_workers(cfg, on_gpu, run),
        },
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


def pass_tokens(cfg: MasterConfig, batching: ResolvedBatching) -> dict[str, int]:
    """Tokens of each pass's largest micro-batch under ``batching``."""
    return {pass_: batching.micro_batch_tokens(cfg.policy, pass_) for pass_ in PASSES}


def _fixes(
    cfg: MasterConfig,
    layout: ResourceLayout,
    parameters: int,
    trainable: int,
    algorithm: Algorithm,
    batching: ResolvedBatching,
) -> list[str]:
    p, fixes = cfg.policy, []
    for pass_ in algorithm_passes(algorithm_settings(cfg, algorithm)):
        best = largest_fitting_tokens(cfg, layout, parameters, trainable, pass_, algorithm)
        if best is not None and best < batching.micro_batch_tokens(p, pass_):
            if batching.section is not None:
                fixes.append(f"policy.{batching.section}.{budget_key(pass_)}={best}")
            else:
                rows = "train_micro_batch_size" if pass_ == "train" else "logprob_batch_size"
                fixes.append(f"policy.{rows}={max(best // p.max_total_sequence_length, 1)}")
    if not p.dtensor_cfg.activation_checkpointing:
        fixes.append("policy.dtensor_cfg.activation_checkpointing=true")
    if p.logprob_chunk_size is None:
        fixes.append("policy.logprob_chunk_size=512")
    return fixes


def memory_problems(
    cfg: MasterConfig,
    layout: ResourceLayout | None = None,
    algorithm: Algorithm = "grpo",
    batching: ResolvedBatching | None = None,
) -> list[str]:
    """One line per way ``cfg``'s estimated peak, with the token budgets of ``batching`` (the run's
    ``resolve_batching``, resolved here if not given), exceeds this machine's memory (none when the recipe
    has no ``policy.architecture`` or the machine's memory cannot be known here)."""
    if cfg.policy.architecture is None or not check_enabled():
        return []
    layout = layout if layout is not None else resource_layout(cfg)
    batching = batching if batching is not None else resolve_batching(cfg, layout, algorithm)
    parameters, trainable = parameter_counts(cfg)
    tokens = pass_tokens(cfg, batching)
    plan = memory_plan(cfg, layout, parameters, trainable, tokens=tokens, algorithm=algorithm)
    if plan.available is None or plan.total() <= REFUSAL_SHARE * plan.available:
        return []
    # on a CPU, say so: a recipe written for a GPU is refused here for want of one, not of memory
    where = "one GPU" if plan.on_gpu else "this machine (no CUDA GPU is visible: it would train on the CPU)"
    worst = max(plan.passes, key=lambda k: sum(plan.passes[k].values()))
    parts = ", ".join(f"{k} {gib(v)}" for k, v in plan.passes[worst].items())
    fixes = _fixes(cfg, layout, parameters, trainable, algorithm, batching)
    return [
        f"memory: the estimated peak, {gib(plan.total())}, exceeds {round(100 * REFUSAL_SHARE)}% of the "
        f"{gib(plan.available)} available on {where} ({worst} pass of {plan.tokens[worst]:,} tokens per "
        f"micro-batch: {parts}"
        + (f"; x {plan.ranks_here} ranks" if plan.ranks_here > 1 else "")
        + (f"; generation {gib(sum(plan.generation.values()))}" if plan.generation else "")
        + f"); fix: {' and/or '.join(fixes)} (or {SKIP_ENV}=off to try anyway)"
    ]


def ensure_fits(
    cfg: MasterConfig, layout: ResourceLayout, batching: ResolvedBatching, algorithm: Algorithm = "grpo"
) -> None:
    """Raises ``ConfigError`` when ``cfg``'s estimated peak memory, with the run's token budgets
    (``batching``, from ``resolve_batching``), exceeds what this machine has."""
    problems = memory_problems(cfg, layout, algorithm, batching)
    if problems:
        raise ConfigError(
            problems, header="the run would not fit in memory (rlfleet plan shows the estimate):"
        )
