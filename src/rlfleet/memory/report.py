"""``rlfleet plan``: the resource layout and memory estimate of a recipe, computed without starting anything.

Memory assumptions (FSDP2 mixed precision as NeMo RL's DTensor path runs it): fp32 master weights, fp32
gradients and fp32 AdamW moments (m and v), all sharded over every training GPU (FSDP over data parallel,
DTensor over tensor parallel); bf16 compute copies, activations and logits come on top
(:mod:`rlfleet.memory.estimate`, compared with this machine by :mod:`rlfleet.memory.planner`). Generation
workers hold the weights in the policy precision, split over their tensor-parallel group, and the rest of
``gpu_memory_utilization`` goes to the KV cache. With LoRA the frozen base weights stay fp32 (sharded) and
only the adapters have gradients and AdamW moments.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.config.algorithm import (
    Algorithm,
    AlgorithmSettings,
    StepFacts,
    algorithm_settings,
    algorithm_spec,
)
from rlfleet.config.backends import backend_of
from rlfleet.config.batching import ResolvedBatching
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.checks import layout_problems, unsupported_settings
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.resolved import policy_precision
from rlfleet.config.schema import MasterConfig
from rlfleet.memory.allocator import find_jemalloc, how_to_get_jemalloc
from rlfleet.memory.estimate import GIB
from rlfleet.memory.planner import (
    BUDGET_HEADROOM,
    BYTES,
    OPTIMIZER_STATE_BYTES,
    count_lora_parameters,
    count_parameters,
    generation_precision,
    largest_fitting_tokens,
    memory_plan,
    memory_problems,
    pass_tokens,
    resolve_batching,
    trains_on_gpu,
)


@dataclass(frozen=True)
class Plan:
    layout: ResourceLayout
    samples_per_step: int  # the sequences one step trains on (a pair is two)
    optimizer_steps_per_step: int
    micro_batches_per_optimizer_step: int
    parameters: int | None
    trainable_parameters: int | None  # all parameters, or the LoRA adapters' count
    gen_memory_utilization: float
    gen_max_model_len: int
    gen_engine: str | None  # the vLLM engine's settings in one line; None with the HF backend
    batching: ResolvedBatching  # the token budgets the run would use on this machine, with why
    optimizer_state_bytes: int  # per trained parameter (AdamW: m and v in float32)
    algorithm: Algorithm  # what the plan is for (the recipe's algorithm: rlfleet.config.recipe_algorithm)
    run: AlgorithmSettings  # what the plan needs of that algorithm's section

    def training_memory_gib(self) -> dict[str, float]:
        if self.parameters is None:
            return {}
        world = self.layout.train_world
        shard = self.parameters / world
        trained = (self.trainable_parameters or self.parameters) / world
        return {
            "weights (fp32)": 4 * shard / GIB,
            "gradients (fp32)": 4 * trained / GIB,
            "optimizer (AdamW m, v fp32)": self.optimizer_state_bytes * trained / GIB,
        }


def make_plan(cfg: MasterConfig, algorithm: Algorithm = "grpo") -> tuple[Plan, list[str]]:
    layout = resource_layout(cfg)
    problems = layout_problems(cfg, layout)
    p, run = cfg.policy, algorithm_settings(cfg, algorithm)
    arch = p.architecture
    parameters = count_parameters(arch) if arch is not None else None
    trainable = parameters
    if parameters is not None and p.dtensor_cfg.lora_cfg.enabled:
        from rlfleet.models.lora import LoraTargetError

        try:
            trainable = count_lora_parameters(cfg)
        except LoraTargetError as err:
            problems = [*problems, str(err)]
            trainable = None
    plan = Plan(
        layout=layout,
        samples_per_step=run.step_rows,
        optimizer_steps_per_step=max(run.step_rows // run.update_rows, 1),
        micro_batches_per_optimizer_step=max(
            p.train_global_batch_size // max(layout.train_dp * p.train_micro_batch_size, 1), 1
        ),
        parameters=parameters,
        trainable_parameters=trainable,
        gen_memory_utilization=p.generation.vllm_cfg.gpu_memory_utilization,
        gen_max_model_len=p.generation.vllm_cfg.max_model_len or p.max_total_sequence_length,
        gen_engine=vllm_engine_summary(cfg, layout=layout) if backend_of(layout).reads_vllm_cfg else None,
        batching=resolve_batching(cfg, layout, algorithm),
        algorithm=algorithm,
        run=run,
        optimizer_state_bytes=OPTIMIZER_STATE_BYTES[p.optimizer.name],
    )
    return plan, problems


def vllm_engine_summary(cfg: MasterConfig, *, layout: ResourceLayout | None = None) -> str:
    """The vLLM engine of a recipe in one line (dtype, context, weights at start, graphs, extra kwargs).

    ``layout``: the recipe's ``resource_layout``, computed from ``cfg`` if not given.
    """
    p, layout = cfg.policy, layout if layout is not None else resource_layout(cfg)
    v = p.generation.vllm_cfg
    weights = "dummy, refitted before the first generation" if v.load_format == "dummy" else "the policy's"
    if uses_ray(cfg, layout=layout):  # a Ray-hosted engine starts without weights and receives the trainer's
        how = "gathered" if p.generation.colocated.enabled else "broadcast from training rank 0"
        weights = f"dummy, then the trainer's ({how}) before the first generation"
    dtype = generation_precision(cfg, layout)
    text = (
        f"vLLM ({'async' if v.async_engine else 'sync'}) {dtype}, max_model_len "
        f"{v.max_model_len or p.max_total_sequence_length}, weights at start: {weights}, "
        f"{'eager' if v.enforce_eager else 'CUDA graphs on GPU'}, refit after every optimizer step"
    )
    return text + (f", vllm_kwargs {sorted(v.vllm_kwargs)}" if v.vllm_kwargs else "")


def _gpus(cfg: MasterConfig, nodes: int, per_node: int) -> str:
    unit = "GPU(s)" if trains_on_gpu(cfg) else "CPU worker process(es)"
    return f"{nodes} node(s) x {per_node} {unit} = {nodes * per_node} {unit}"


def _rows(cfg: MasterConfig, plan: Plan) -> list[tuple[str, str]]:
    lay, p = plan.layout, cfg.policy
    training = (
        "training",
        f"{_gpus(cfg, lay.train_nodes, lay.train_gpus_per_node)}: TP {lay.train_tp} x DP {lay.train_dp}",
    )
    if not plan.run.samples:  # a reward model: training ranks alone
        workers = (
            f"Ray: {lay.train_world} training actor(s) in {lay.train_nodes} placement group(s)"
            if uses_ray(cfg, layout=lay)
            else "this process (no Ray)"
        )
        return [
            ("cluster", _gpus(cfg, lay.num_nodes, lay.gpus_per_node)),
            ("workers", workers),
            ("generation", "none: a reward model samples nothing"),
            training,
            *_step_rows(cfg, plan),
            ("sequence budget", f"{p.max_total_sequence_length} tokens"),
        ]
    where = (
        "colocated with training"
        if lay.colocated
        else f"dedicated {_gpus(cfg, lay.gen_nodes, lay.gen_gpus_per_node)}"
    )
    return [
        ("cluster", _gpus(cfg, lay.num_nodes, lay.gpus_per_node)),
        ("workers", _workers(cfg, lay)),
        ("placement", f"generation {where}; {lay.backend}, TP {lay.gen_tp} -> {lay.gen_engines} engine(s)"),
        *([("engine", plan.gen_engine)] if plan.gen_engine else []),
        training,
        *_step_rows(cfg, plan),
        (
            "sequence budget",
            f"{p.max_total_sequence_length} tokens, max_new_tokens {p.generation.max_new_tokens}",
        ),
        *_described(cfg, plan),
    ]


def _step_rows(cfg: MasterConfig, plan: Plan) -> list[tuple[str, str]]:
    """What one step of ``plan.algorithm`` draws and how its optimizer steps split it: the algorithm's own
    rows (its description's ``step_rows``, reading its own section)."""
    facts = StepFacts(
        samples_per_step=plan.samples_per_step,
        optimizer_steps=plan.optimizer_steps_per_step,
        per_update=lambda unit: _micro_batches(cfg, plan, unit=unit),
    )
    return algorithm_spec(plan.algorithm).step_rows(cfg, facts)


def _described(cfg: MasterConfig, plan: Plan) -> list[tuple[str, str]]:
    """The algorithm as configured, where its description says how (GRPO's variant, loss, sampling...)."""
    describe = algorithm_spec(plan.algorithm).describe
    return describe(cfg, plan.batching) if describe is not None else []


def _micro_batches(cfg: MasterConfig, plan: Plan, unit: str = "row") -> str:
    p, dp = cfg.policy, plan.layout.train_dp
    if plan.batching.section is not None:
        rows = -(-p.train_global_batch_size // dp)
        return (
            f"{rows} {unit}(s) per optimizer step per rank (DP {dp}), split by the token budgets below "
            "(train_micro_batch_size and logprob_batch_size are not used)"
        )
    return (
        f"{plan.micro_batches_per_optimizer_step} micro-batch(es) of {p.train_micro_batch_size} {unit}(s) "
        f"per optimizer step per rank (DP {dp})"
    )


def _workers(cfg: MasterConfig, lay: ResourceLayout) -> str:
    backend = backend_of(lay)
    engine = f"{backend.display_name} engine"
    if not uses_ray(cfg, layout=lay):
        if backend.holds_own_weights:
            return f"this process (no Ray) + its {engine} process (holds its own weights)"
        return "this process (no Ray); generation shares the model"
    text = f"Ray: {lay.train_world} training actor(s) in {lay.train_nodes} placement group(s)"
    if lay.colocated:
        if backend.holds_own_weights:
            return (
                text + f"; {lay.gen_engines} of them also host a {engine} over the GPU(s) of {lay.gen_tp} "
                "rank(s) (refit from the gathered weights)"
            )
        return text + ", each also generating (refit in place)"
    if backend.tensor_parallel:
        return (
            text + f" + {lay.gen_engines} {engine} actor(s) of {lay.gen_tp} GPU(s) each "
            "(refit by broadcast from training rank 0)"
        )
    return text + f" + {lay.gen_world} generation actor(s) (refit by broadcast from training rank 0)"


def _jemalloc_hint(cfg: MasterConfig, plan: Plan, glibc_train: dict[str, float], trainable: int) -> str:
    """What the training pass would save on jemalloc, and how to get it (glibc keeps part of what a
    backward frees: ``heap_retention_bytes`` of :mod:`rlfleet.memory.estimate`)."""
    assert plan.parameters is not None
    tokens = pass_tokens(cfg, plan.batching)
    on_jemalloc = memory_plan(
        cfg,
        plan.layout,
        plan.parameters,
        trainable,
        tokens=tokens,
        algorithm=plan.algorithm,
        allocator="jemalloc",
    )
    saved = (sum(glibc_train.values()) - sum(on_jemalloc.passes["train"].values())) / GIB
    return f"    {'':<22}jemalloc would cut the train pass peak by {saved:.1f} GiB: " + how_to_get_jemalloc(
        find_jemalloc()
    )


def _memory_lines(cfg: MasterConfig, plan: Plan) -> list[str]:
    """The state of one training rank, each pass's peak by part, generation, and the machine's verdict."""
    assert plan.parameters is not None
    lay, p = plan.layout, cfg.policy
    trainable = plan.trainable_parameters or plan.parameters
    tokens = pass_tokens(cfg, plan.batching)
    mem = memory_plan(cfg, lay, plan.parameters, trainable, tokens=tokens, algorithm=plan.algorithm)
    rank = "training GPU" if mem.on_gpu else "training process (CPU)"
    shard = f"state sharded over {lay.train_world}" if uses_ray(cfg, layout=lay) else "whole model"
    lines = [f"  memory per {rank} ({shard}; {policy_precision(cfg).name} compute):"]
    for pass_, parts in mem.passes.items():
        detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items())
        lines.append(
            f"    {pass_ + ' pass peak':<22}{sum(parts.values()) / GIB:6.1f} GiB  "
            f"({mem.tokens[pass_]:,} tokens per micro-batch: {detail})"
        )
    knobs = [
        f"activation checkpointing {'on' if p.dtensor_cfg.activation_checkpointing else 'off'}",
        f"logprobs in chunks of {p.logprob_chunk_size}" if p.logprob_chunk_size else "whole logits",
    ]
    if not mem.on_gpu:
        knobs.append(f"{mem.allocator} malloc")
    lines.append(f"    {'':<22}{'; '.join(knobs)}")
    if not mem.on_gpu and mem.allocator == "glibc":
        lines.append(_jemalloc_hint(cfg, plan, mem.passes["train"], trainable))
    backend = backend_of(lay)
    if mem.generation:  # a CPU vLLM engine, a teacher actor, environment workers
        detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.generation.items())
        lines.append(f"  {'beside the ranks':<20}{sum(mem.generation.values()) / GIB:.1f} GiB ({detail})")
    if plan.run.samples and (mem.on_gpu or not backend.own_memory):  # an engine not counted above
        gen_precision = generation_precision(cfg, lay)
        gen_weights = plan.parameters * BYTES[gen_precision] / lay.gen_tp / GIB
        where = "per generation GPU" if mem.on_gpu else "generation"
        kv = (
            f"; KV cache: the rest of gpu_memory_utilization={plan.gen_memory_utilization} "
            f"(max_model_len {plan.gen_max_model_len})"
            if backend.own_memory
            else "; shares the policy's weights"
            if lay.colocated and not backend.holds_own_weights
            else ""
        )
        lines.append(
            f"  {'generation memory':<20}{where}: weights ({gen_precision}) {gen_weights:.2f} GiB{kv}"
        )
    if mem.available is None:
        lines.append(f"  {'fits':<20}not compared: this machine is not where the run trains")
        return lines
    what = "one GPU" if mem.on_gpu else "this machine"
    ranks = f"{mem.ranks_here} rank(s)" + (" + beside them" if mem.generation else "")
    problems = memory_problems(cfg, lay, plan.algorithm, plan.batching)
    verdict = "does NOT fit: `validate` and the run refuse it" if problems else "fits"
    lines.append(
        f"  {'fits':<20}{verdict}: estimate {mem.total() / GIB:.1f} GiB ({ranks}) of "
        f"{mem.available / GIB:.1f} GiB available on {what}"
    )
    lines += [f"  {'':<20}{problem}" for problem in problems]
    section = plan.batching.section
    if section is not None:
        best = largest_fitting_tokens(cfg, lay, plan.parameters, trainable, "train", plan.algorithm)
        lines.append(
            f"  {'largest budget':<20}policy.{section}.train_mb_tokens={best} fits with "
            f"{100 - round(100 * BUDGET_HEADROOM)}% headroom"
            if best
            else f"  {'largest budget':<20}no training token budget fits with headroom"
        )
    return lines


def format_plan(cfg: MasterConfig, plan: Plan, recipe: str) -> str:
    """The plan as the text ``rlfleet plan`` prints."""
    lines = [f"plan for {recipe} ({plan.algorithm})"] + [f"  {k:<20}{v}" for k, v in _rows(cfg, plan)]
    lines += [
        f"  {'not in this build':<20}{problem}" for problem in unsupported_settings(cfg, layout=plan.layout)
    ]
    if plan.parameters is None:
        lines.append(f"  {'model':<20}no policy.architecture in the recipe: memory not estimated")
        return "\n".join(lines)
    p = cfg.policy
    lines.append(f"  {'model':<20}{p.model_name}: {plan.parameters / 1e9:.2f}B parameters")
    if p.dtensor_cfg.lora_cfg.enabled and plan.trainable_parameters is not None:
        lo, trained, state = p.dtensor_cfg.lora_cfg, plan.trainable_parameters, plan.optimizer_state_bytes
        lines.append(
            f"  {'LoRA':<20}dim {lo.dim}, alpha {lo.alpha:g}: {trained:,} trainable parameters "
            f"({100 * trained / plan.parameters:.2f}%); AdamW state {state * trained / 2**20:,.1f} MiB "
            f"vs {state * plan.parameters / 2**20:,.1f} MiB for full fine-tuning"
        )
    lines += _memory_lines(cfg, plan)
    return "\n".join(lines)
