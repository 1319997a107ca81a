"""Every check of a config that one field alone cannot make, reported from one place.

The schema (:mod:`rlfleet.config.schema`) checks single fields: types, ranges, choices. What depends on
several fields is checked here, and every problem found is reported at once, each one line naming the dotted
key, the offending value, the constraint and a fix:

* :func:`check_config`: everything that keeps a config from running an algorithm: the fields of one
  section against each other, batch arithmetic, micro-batch budgets, what the algorithm trains on
  (:mod:`rlfleet.config.pair_checks`), the algorithm's own checks (its description's ``checks``, in its
  folder), the checkpoint metric, the resources, and the resource layout (:func:`layout_problems`). Runs,
  ``rlfleet validate``, ``plan`` and ``k8s render`` call it before anything starts.
* :func:`section_problems`: the fields of one section against each other;
  :func:`rlfleet.config.validate_config` reports them too, so a recipe that loads is consistent.
* :func:`unsupported_settings` / :func:`ensure_runnable`: settings the schema knows (NeMo RL keys) that this
  build cannot honour: listed by ``validate`` and ``plan``, refused by the runs, never silently ignored.

What needs the resource layout takes it (``layout=``), computed once per run with
:func:`rlfleet.config.layout.resource_layout`, or computes it from the config.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from rlfleet.config.algorithm import Algorithm, AlgorithmSpec, algorithm_names, spec_of
from rlfleet.config.backends import BACKENDS, GenerationBackendInfo, backend_of
from rlfleet.config.batching import PASSES, budget_key, recipe_budget, token_budget_section
from rlfleet.config.capabilities import needs_several_processes, uses_ray
from rlfleet.config.embedded import DEMO_COMMANDS, DEMO_TASKS
from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.config.metric_names import normalize_metric_name
from rlfleet.config.pair_checks import pair_problems
from rlfleet.config.schema import BUILTIN_ENVIRONMENTS, MasterConfig
from rlfleet.utils.intmath import divisors_near, round_up

__all__ = [
    "Algorithm",
    "check_config",
    "ensure_runnable",
    "layout_problems",
    "rollout_turn_problems",
    "section_problems",
    "unsupported_settings",
]

# ------------------------------------------------------------------------------------------- entry points


def check_config(
    cfg: MasterConfig, algorithm: str | AlgorithmSpec, *, layout: ResourceLayout | None = None
) -> None:
    """Check what single fields cannot: the sections' own consistency, batch arithmetic, micro-batch
    budgets, what the algorithm trains on, its own checks, the checkpoint metric, resources and the layout.

    Args:
        cfg: The validated config.
        algorithm: The algorithm's name or description (:mod:`rlfleet.config.algorithm`); its own checks
            (its description's ``checks``: GRPO's variants, distillation's teacher, ...) run for it alone.
        layout: ``resource_layout(cfg)`` when the caller has it already; computed here if not.

    Raises:
        ConfigError: listing every problem for the algorithm (an unknown algorithm, too).
    """
    spec = spec_of(algorithm)
    layout = layout if layout is not None else resource_layout(cfg)
    problems = section_problems(cfg)
    if cfg.algorithm is not None and cfg.algorithm != spec.name:
        problems.append(
            f"algorithm: the recipe is for {cfg.algorithm}, but this runs {spec.name}; fix: "
            f"`rlfleet {spec_of(cfg.algorithm).command} RECIPE`, or algorithm={spec.name}"
        )
    problems += _model_name_problems(cfg)
    problems += _batch_problems(cfg)
    problems += _micro_batching_problems(cfg)
    problems += pair_problems(cfg, spec, layout)
    problems += _rollout_turn_problems(cfg, spec)
    if spec.checks is not None:
        problems += spec.checks(cfg, layout)
    problems += _metric_problems(cfg, spec)
    resource_problems = _resource_problems(cfg)
    problems += resource_problems or layout_problems(cfg, layout)
    if problems:
        raise ConfigError(problems, header=f"config cannot run {spec.name} ({len(problems)} problem(s)):")


def ensure_runnable(cfg: MasterConfig, *, layout: ResourceLayout | None = None) -> None:
    """Raises ``ConfigError`` listing every setting this build would have to ignore to run ``cfg``."""
    problems = unsupported_settings(cfg, layout=layout)
    if problems:
        raise ConfigError(problems, header=f"this build cannot run the config as given ({len(problems)}):")


# ---------------------------------------------------------------------------------- one section's fields


def section_problems(cfg: MasterConfig) -> list[str]:
    """Fields of one section that contradict each other (LoRA targets, the arithmetic task's operation
    counts, the system prompt, pass@k), each prefixed with the section's dotted key."""
    problems = []
    if cfg.algorithm is not None and cfg.algorithm not in algorithm_names():
        problems.append(
            f"algorithm: got {cfg.algorithm!r}, expected one of {', '.join(algorithm_names())}; fix: "
            "algorithm=grpo (for example), or remove the key (the recipe's one algorithm section decides)"
        )
    lora = cfg.policy.dtensor_cfg.lora_cfg
    where = "policy.dtensor_cfg.lora_cfg"
    if lora.enabled and lora.match_all_linear and lora.target_modules:
        problems.append(
            f"{where}: {where}.target_modules={lora.target_modules} with "
            "match_all_linear=true: match_all_linear adapts every linear layer, so the list would be "
            "ignored; fix: match_all_linear=false to adapt only target_modules, or target_modules=[]"
        )
    if lora.enabled and not lora.match_all_linear and not lora.target_modules:
        problems.append(
            f"{where}: {where}: match_all_linear=false and target_modules is empty, so no "
            "layer would be adapted; fix: target_modules=[q_proj,v_proj] (for example), or "
            "match_all_linear=true"
        )
    arithmetic = cfg.data.arithmetic
    if arithmetic.min_ops > arithmetic.max_ops:
        problems.append(
            f"data.arithmetic: data.arithmetic.min_ops={arithmetic.min_ops} exceeds "
            f"max_ops={arithmetic.max_ops}; set min_ops <= max_ops"
        )
    m = cfg.data.multiplication
    if m.min_digits > m.max_digits:
        problems.append(
            f"data.multiplication: data.multiplication.min_digits={m.min_digits} exceeds "
            f"max_digits={m.max_digits}; set min_digits <= max_digits"
        )
    known = {*BUILTIN_ENVIRONMENTS, *cfg.env.custom()}
    if cfg.data.env_name not in known:
        problems.append(
            f"data.env_name: {cfg.data.env_name!r} is not an environment of the recipe (known: "
            f"{', '.join(sorted(known))}); fix: one of them, or add env.{cfg.data.env_name}.environment="
            "<import path of your EnvironmentInterface class>"
        )
    scorers = {"reward_model": cfg.env.reward_model.model_name, "judge": cfg.env.judge.model_name}
    if cfg.data.env_name in scorers and not scorers[cfg.data.env_name].strip():
        problems.append(
            f"env.{cfg.data.env_name}.model_name: empty, but data.env_name={cfg.data.env_name} scores with "
            f"that model; fix: env.{cfg.data.env_name}.model_name=<hub id or local directory>"
        )
    if cfg.data.env_name == "agent" and not cfg.env.agent.agent_fn.strip():
        problems.append(
            "env.agent.agent_fn: empty, but data.env_name=agent runs an agent function; fix: "
            "env.agent.agent_fn=<package.module:function or path/to/file.py:function>"
        )
    if cfg.data.system_prompt is not None and cfg.data.system_prompt_file is not None:
        problems.append("data: data.system_prompt and data.system_prompt_file are both set; keep one of them")
    e = cfg.eval
    if e.pass_k_value > e.num_tests_per_prompt:
        problems.append(
            f"eval: eval.pass_k_value={e.pass_k_value} exceeds eval.num_tests_per_prompt="
            f"{e.num_tests_per_prompt}; raise num_tests_per_prompt to at least k"
        )
    return problems


# ----------------------------------------------------------------------------------- model and batches


def _model_name_problems(cfg: MasterConfig) -> list[str]:
    name = cfg.policy.model_name.strip()
    if name:
        return _unbuilt_demo_model(name)
    return [
        f"policy.model_name: got {cfg.policy.model_name!r}, expected a Hugging Face hub id or a local "
        "model directory; fix: set it in the recipe or on the command line "
        "(e.g. policy.model_name=Qwen/Qwen2.5-0.5B-Instruct)"
    ]


def _rollout_turn_problems(cfg: MasterConfig, spec: AlgorithmSpec) -> list[str]:
    """The turns of the algorithm's episodes (in training or validation; its own ``max_rollout_turns``)
    against the environment; nothing for an algorithm that samples nothing."""
    run = spec.settings(cfg)
    if run.rollout_turns is None or run.turns_key is None:
        return []
    return rollout_turn_problems(cfg, run.rollout_turns, run.turns_key)


def rollout_turn_problems(cfg: MasterConfig, turns: int, key: str) -> list[str]:
    """Episodes of ``turns`` model turns (set by ``key``) against the default environment
    (``data.env_name``): the tools environment answers a tool call in the next turn, so it needs two at
    least."""
    if cfg.data.env_name != "tools" or turns >= 2:
        return []
    return [
        f"{key}: the tools environment answers a tool call in the next turn, so with {key}={turns} no "
        f"call would ever get its result; fix: {key}=3 (a call, maybe a second, the answer)"
    ]


def _batch_problems(cfg: MasterConfig) -> list[str]:
    policy, problems = cfg.policy, []
    batch, micro = policy.train_global_batch_size, policy.train_micro_batch_size
    if batch % micro:
        suggestions = ", ".join(map(str, divisors_near(batch, micro)))
        problems.append(
            f"policy.train_global_batch_size={batch} is not divisible by "
            f"policy.train_micro_batch_size={micro}, so gradient accumulation cannot cover the batch "
            f"exactly; fix: set policy.train_micro_batch_size to a divisor of {batch} (e.g. {suggestions})"
        )
    return problems


def _micro_batching_problems(cfg: MasterConfig) -> list[str]:
    """Dynamic batching and sequence packing at once, and token budgets a maximal sequence would not fit."""
    p = cfg.policy
    dyn, pack = p.dynamic_batching, p.sequence_packing
    if dyn.enabled and pack.enabled:
        return [
            "policy.dynamic_batching.enabled and policy.sequence_packing.enabled are both true, but a "
            "micro-batch is either padded rows grouped by tokens or packed rows, not both (NeMo RL refuses "
            "this too); fix: set one of them to false (sequence packing pads each packed row by at most 1/16)"
        ]
    name = token_budget_section(p)
    if name is None:
        return []
    longest = p.max_total_sequence_length
    why = f"policy.max_total_sequence_length={longest}"
    if name == "dynamic_batching":
        longest = round_up(longest, dyn.sequence_length_round)
        why += f" rounded up to sequence_length_round={dyn.sequence_length_round}"
    problems = []
    for pass_ in PASSES:
        tokens = recipe_budget(p, name, pass_).tokens
        if tokens < longest:
            problems.append(
                f"policy.{name}.{budget_key(pass_)}={tokens} is smaller than the longest sequence a step "
                f"can hold ({longest} tokens: {why}), so such a sequence would fit no micro-batch; fix: "
                f"policy.{name}.{budget_key(pass_)}={longest} or more (or null for "
                "max_total_sequence_length x the micro-batch rows)"
            )
    return problems


# ------------------------------------------------------------------------------------- checkpoint metric


def _metric_problems(cfg: MasterConfig, spec: AlgorithmSpec) -> list[str]:
    ckpt = cfg.checkpointing
    if not ckpt.enabled or ckpt.keep_top_k is None or ckpt.metric_name is None:
        return []
    logged, name = spec.metrics, normalize_metric_name(ckpt.metric_name)
    if name in logged:
        return []
    close = difflib.get_close_matches(name, sorted(logged), n=1, cutoff=0)
    return [
        f"checkpointing.metric_name: got {ckpt.metric_name!r}, but {spec.name} logs only "
        f"{', '.join(sorted(logged))} (':' and '/' are interchangeable, surrounding spaces are dropped), "
        "so checkpoints could not be ranked; "
        f"fix: set checkpointing.metric_name to one of those (e.g. {close[0]}), or "
        "checkpointing.keep_top_k=null to keep every checkpoint"
    ]


# -------------------------------------------------------------------------------- resources and layout


def _resource_problems(cfg: MasterConfig) -> list[str]:
    colocated = cfg.policy.generation.colocated
    if colocated.enabled:
        return []
    prefix = "policy.generation.colocated.resources"
    return [
        f"{prefix}.{name}: got None, but policy.generation.colocated.enabled=false (generation on its own "
        f"GPUs) needs it; fix: set {prefix}.{name} to an integer >= 1, or "
        "policy.generation.colocated.enabled=true"
        for name in ("num_nodes", "gpus_per_node")
        if getattr(colocated.resources, name) is None
    ]


# ------------------------------------------------------------------------------------ what this build lacks


def unsupported_settings(
    cfg: MasterConfig, *, here: bool = True, layout: ResourceLayout | None = None
) -> list[str]:
    """Problems for every configured feature that this build would otherwise silently skip.

    ``here=False`` leaves out what depends on this machine's packages (ray, vllm installed), for a run
    that happens elsewhere (a rendered Kubernetes job runs in the image, which has them). ``layout``:
    ``resource_layout(cfg)`` when the caller has it already.
    """
    problems: list[str] = []
    layout = layout if layout is not None else resource_layout(cfg)
    if cfg.cluster.use_ray is False and needs_several_processes(layout):
        problems.append(
            f"cluster.use_ray=false, but the layout needs {layout.train_world} training process(es)"
            + ("" if layout.colocated else " and dedicated generation workers")
            + "; fix: cluster.use_ray=true (or leave it unset), or a single-process layout"
        )
    if here and uses_ray(cfg, layout=layout) and importlib.util.find_spec("ray") is None:
        problems.append(
            "this run needs Ray (several workers), but ray is not installed; fix: pip install 'rlfleet[ray]'"
        )
    if cfg.policy.torch_compile and uses_ray(cfg, layout=layout):
        problems.append(
            "policy.torch_compile=true on Ray: this build compiles the layers of an in-process policy only "
            "(compiled layers under FSDP2 on Ray workers are not supported yet); "
            "fix: policy.torch_compile=false, or a single-process layout"
        )
    d = cfg.policy.dtensor_cfg
    if not d.enabled:
        problems.append(
            "policy.dtensor_cfg.enabled: got false, but rlfleet trains with the DTensor/FSDP2 path only "
            "(there is no Megatron backend); fix: policy.dtensor_cfg.enabled=true"
        )
    for key, value in (("cpu_offload", d.cpu_offload), ("sequence_parallel", d.sequence_parallel)):
        if value:
            problems.append(
                f"policy.dtensor_cfg.{key}: got true, but this build does not implement it yet; "
                f"fix: policy.dtensor_cfg.{key}=false"
            )
    if d.lora_cfg.enabled and d.tensor_parallel_size > 1:
        problems.append(
            f"policy.dtensor_cfg.lora_cfg.enabled=true with tensor_parallel_size={d.tensor_parallel_size}: "
            "this build does not split LoRA adapters over tensor-parallel ranks (the adapted projections "
            "would need their own column/row plans); fix: policy.dtensor_cfg.tensor_parallel_size=1 "
            "(FSDP2 still shards the model over every GPU), or lora_cfg.enabled=false"
        )
    return problems + _backend_problems(cfg, backend_of(layout), here) + _judge_problems(cfg, here)


def _judge_problems(cfg: MasterConfig, here: bool) -> list[str]:
    """A judge run by rlfleet with a backend whose package is not installed here."""
    judge = cfg.env.judge
    backend = BACKENDS[judge.backend]
    if not here or cfg.data.env_name != "judge" or judge.base_url or backend.package is None:
        return []
    if importlib.util.find_spec(backend.package) is not None:
        return []
    return [
        f"env.judge.backend: got {backend.name!r}, but {backend.package} is not installed; fix: "
        f"{backend.install_hint}, or env.judge.backend=hf"
    ]


def _backend_problems(cfg: MasterConfig, backend: GenerationBackendInfo, here: bool) -> list[str]:
    """What the generation backend cannot do in this build (in one process, colocated or dedicated on Ray):
    a package it needs missing here, vLLM's async engine, logprobs of a filtered distribution."""
    g, problems = cfg.policy.generation, []
    if here and backend.package is not None and importlib.util.find_spec(backend.package) is None:
        problems.append(
            f"policy.generation.backend: got {backend.name!r}, but {backend.package} is not installed; fix: "
            f"{backend.install_hint}, or policy.generation.backend=hf"
        )
    if backend.reads_vllm_cfg and g.vllm_cfg.async_engine:
        problems.append(
            "policy.generation.vllm_cfg.async_engine: got true, but this build drives vLLM synchronously; "
            "fix: policy.generation.vllm_cfg.async_engine=false"
        )
    if backend.filtered_logprobs and (g.top_k is not None or g.top_p < 1.0):
        problems.append(
            f"policy.generation.top_k={g.top_k} / top_p={g.top_p} with backend={backend.name}: "
            f"{backend.display_name} reports logprobs under the top-k/top-p filtered distribution, not the "
            "full softmax the trainer computes, so gen_logprob_error and the importance-sampling correction "
            "would be off; fix: top_k=null and top_p=1.0, or policy.generation.backend=hf"
        )
    return problems


# ------------------------------------------------------------------------------------------ the layout


def layout_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    """Why ``layout`` (``resource_layout(cfg)``) cannot run: a dedicated generation pool that does not fit
    the cluster, tensor parallelism that leaves a node or does not divide its pool, a global batch that the
    data-parallel size does not divide. Empty when it can run."""
    problems = [] if layout.colocated else _dedicated_pool_problems(cfg)
    problems += _tp_problems(
        "policy.dtensor_cfg.tensor_parallel_size",
        layout.train_tp,
        layout.train_gpus_per_node,
        layout.train_world,
    )
    if backend_of(layout).tensor_parallel:
        problems += _tp_problems(
            "policy.generation.vllm_cfg.tensor_parallel_size",
            layout.gen_tp,
            layout.gen_gpus_per_node,
            layout.gen_world,
        )
    if not problems:
        problems += _data_parallel_problems(cfg, layout)
    return problems


def _dedicated_pool_problems(cfg: MasterConfig) -> list[str]:
    c, res = cfg.cluster, cfg.policy.generation.colocated.resources
    key = "policy.generation.colocated.resources"
    gen_nodes, gen_gpn = res.num_nodes or 0, res.gpus_per_node or 0
    problems: list[str] = []
    if gen_gpn > c.gpus_per_node:
        problems.append(
            f"{key}.gpus_per_node={gen_gpn} exceeds cluster.gpus_per_node={c.gpus_per_node}; "
            f"fix: at most {c.gpus_per_node}"
        )
    if c.num_nodes == 1:
        if gen_nodes > 1:
            problems.append(f"{key}.num_nodes={gen_nodes} but the cluster has 1 node; fix: {key}.num_nodes=1")
        if gen_gpn >= c.gpus_per_node:
            problems.append(
                f"{key}.gpus_per_node={gen_gpn} leaves no training GPU on the single node of "
                f"{c.gpus_per_node}; fix: at most {c.gpus_per_node - 1}, or colocated.enabled=true"
            )
    elif gen_nodes >= c.num_nodes:
        problems.append(
            f"{key}.num_nodes={gen_nodes} leaves no training node of cluster.num_nodes={c.num_nodes}; "
            f"fix: at most {c.num_nodes - 1} generation node(s), or more cluster nodes"
        )
    return problems


def _tp_problems(name: str, tp: int, gpus_per_node: int, world: int) -> list[str]:
    if gpus_per_node and (tp > gpus_per_node or gpus_per_node % tp):
        divisors = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]
        return [
            f"{name}={tp} must divide the {gpus_per_node} GPUs per node it runs on (tensor parallelism "
            f"stays inside a node); fix: one of {divisors}"
        ]
    if world and world % tp:
        return [f"{name}={tp} does not divide the {world} GPUs of its pool"]
    return []


def _data_parallel_problems(cfg: MasterConfig, layout: ResourceLayout) -> list[str]:
    p = cfg.policy
    per_step = layout.train_dp * p.train_micro_batch_size
    # gbs % micro is checked on its own; this adds the data-parallel factor
    if p.train_global_batch_size % p.train_micro_batch_size == 0 and p.train_global_batch_size % per_step:
        return [
            f"policy.train_global_batch_size={p.train_global_batch_size} must be a multiple of data-parallel "
            f"size {layout.train_dp} x policy.train_micro_batch_size={p.train_micro_batch_size} "
            f"= {per_step}; "
            f"fix: policy.train_global_batch_size={per_step * max(1, p.train_global_batch_size // per_step)}"
        ]
    return []


def _unbuilt_demo_model(model_name: str) -> list[str]:
    """A tiny recipe's model directory (``runs/demo/sft_model``...) that its embedded job has not built yet:
    the command that builds it."""
    for task, (_, _, out) in DEMO_TASKS.items():
        if Path(model_name).parts[:2] == Path(out).parts and not Path(model_name).is_dir():
            return [
                f"policy.model_name={model_name}: that model is not built yet; `{DEMO_COMMANDS[task]}` "
                f"builds it (rlfleet demo --task {task}), or set policy.model_name to a model of yours"
            ]
    return []
