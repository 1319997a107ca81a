"""``rlfleet rehearse``: a recipe's training ranks run at their real scale on this machine, without the GPUs.

For each distinct rank role of the recipe's layout one process pretends to be that rank of the full training
world on torch's fake process group (the ``fake`` backend: collectives return at once, nothing is sent),
builds the model through rlfleet's own code (``ModelSource`` with its weights on the meta device, from the
model's real configuration: :mod:`rlfleet.config.architectures`; ``build_policy_models`` with the recipe's
mesh, so rlfleet's tensor-parallel plan, activation checkpointing and FSDP2 sharding), materialises it as fake
tensors (shapes and dtypes, no memory), and under torch's ``FSDPMemTracker`` runs one logprob micro-batch
(the policy's, then the reference's) and one training micro-batch (forward, backward, AdamW step) at the
recipe's token budgets. The tracker's peak, by kind (parameters, gradients, optimizer state, activations
and temporaries), is printed beside ``plan``'s estimate and the memory of the GPUs the recipe may run on.

Before anything runs, every linear weight of every decoder layer is checked to be split by the
tensor-parallel plan (:func:`rlfleet.policy.parallelize.unsharded_linears`): a projection the plan misses
would be replicated on every rank, silently multiplying its memory; the rehearsal refuses it.

The generation side is arithmetic on the same configuration (:func:`generation_rows`): vLLM's
tensor-parallel divisibility, the weights per GPU, the KV-cache tokens that fit at
``gpu_memory_utilization`` and so how many of a step's sequences run at once.

All ranks of one role hold the same shapes (FSDP2 pads uneven shards), so one process per role stands for
them: rank 0 of the training world.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from rlfleet.config import MasterConfig
from rlfleet.config.algorithm import algorithm_spec
from rlfleet.config.architectures import load_model_config
from rlfleet.config.layout import ResourceLayout, resource_layout
from rlfleet.errors import UserError

GB = 1e9
GPU_MEMORY_GB = {"H100": 80.0, "H200": 141.0, "B200": 180.0}
"""Each GPU's memory as sold (10^9 bytes), what the per-rank peaks are compared against."""

KINDS = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Temp", "Inputs", "All Gather", "Reduce Scatter"),
}
"""The tracker's kinds of memory (``FSDPMemTracker``'s reference types), grouped as the table prints them."""

_TOTAL = "Total"  # the tracker's key of the sum over kinds
RANK_TIMEOUT_S = 900.0
"""The most one rank's rehearsal may take (the seed recipe's takes about a minute on 2 cores)."""


@dataclass(frozen=True)
class RankJob:
    """What one rank process rehearses (JSON between the processes)."""

    role: str
    model_name: str
    precision: str
    world: int
    rank: int
    tensor_parallel: int
    activation_checkpointing: bool
    keep_reference: bool
    train_rows: int
    train_tokens: int
    logprob_rows: int
    logprob_tokens: int
    logprob_chunk: int | None
    lr: float


def rank_jobs(cfg: MasterConfig, layout: ResourceLayout) -> list[RankJob]:
    """One job per distinct training rank role of ``cfg``'s layout."""
    from rlfleet.memory.planner import pass_tokens, resolve_batching

    spec = algorithm_spec(cfg.algorithm or "grpo")
    run = spec.settings(cfg)
    batching = resolve_batching(cfg, layout, spec.name)
    tokens = pass_tokens(cfg, batching)
    p = cfg.policy
    length = p.max_total_sequence_length
    return [
        RankJob(
            role=f"training rank 0 of {layout.train_world} (TP {layout.train_tp} x DP {layout.train_dp})",
            model_name=p.model_name,
            precision=p.precision if p.precision != "auto" else "bfloat16",
            world=layout.train_world,
            rank=0,
            tensor_parallel=layout.train_tp,
            activation_checkpointing=p.dtensor_cfg.activation_checkpointing,
            keep_reference=run.keeps_reference,
            train_rows=max(tokens["train"] // length, 1),
            train_tokens=length,
            logprob_rows=max(tokens["logprob"] // length, 1),
            logprob_tokens=length,
            logprob_chunk=p.logprob_chunk_size,
            lr=p.optimizer.kwargs.lr,
        )
    ]


def run_rank(job: RankJob) -> dict[str, Any]:
    """Rehearses ``job`` in this process (which it makes rank ``job.rank`` of a fake world): the tracker's
    peak bytes by kind, the parameter counts, and the weights the plan left whole."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlfleet.models.loading import ModelSource
    from rlfleet.policy.build import build_policy_models
    from rlfleet.policy.parallelize import build_mesh, unsharded_linears

    dist.init_process_group("fake", store=FakeStore(), rank=job.rank, world_size=job.world)
    try:
        mesh = build_mesh(job.tensor_parallel, "cpu")
        source = ModelSource(job.model_name, precision=job.precision, meta_weights=True)
        models = build_policy_models(
            source,
            torch.device("meta"),
            activation_checkpointing=job.activation_checkpointing,
            keep_reference=job.keep_reference,
            mesh=mesh,
        )
        model, reference = models.model, models.reference
        whole = unsharded_linears(model, job.tensor_parallel)
        if whole:
            return {"role": job.role, "unsharded": whole}
        counts = _parameter_counts(model)
        # the reference is not the tracked module: its shards, held through the whole step, are added
        held = 0 if reference is None else _local_bytes(reference)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            if isinstance(reference, torch.nn.Module):  # LoRA's reference is the policy, adapters off
                reference.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr, foreach=False)
            vocab = model.config.get_text_config().vocab_size
            ids = torch.randint(0, vocab, (job.train_rows, job.train_tokens))
            advantages = torch.randn(job.train_rows, 1)

            def train_pass() -> None:
                loss = -(advantages * _token_logprobs(model, ids, job.logprob_chunk)).mean()
                loss.backward()

            train_pass()  # a first step outside the tracker allocates AdamW's state, as every later step has
            optimizer.step()
            optimizer.zero_grad()
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                with torch.no_grad():
                    scoring = torch.randint(0, vocab, (job.logprob_rows, job.logprob_tokens))
                    for scorer in (model, reference):
                        if scorer is not None:
                            _token_logprobs(scorer, scoring, job.logprob_chunk)
                            tracker.reset_mod_stats()  # the tracker follows one call of a module at a time
                train_pass()
                # the optimizer step holds the weights, their gradients and AdamW's state; a fused step (a
                # GPU's) adds nothing to them, so the step is not run under the tracker, whose unfused CPU
                # step would add per-parameter temporaries a GPU run does not have
                at_step = tracker.get_tracker_snapshot()
            peak = tracker.get_tracker_snapshot("peak")
        passes = next(iter(peak.values()))
        step = next(iter(at_step.values()))
        by_type = passes if passes[_TOTAL] >= step[_TOTAL] else step
        named = {getattr(k, "value", str(k)): float(v) for k, v in by_type.items()}
        kinds = {kind: sum(named.get(name, 0.0) for name in names) for kind, names in KINDS.items()}
        kinds["parameters"] += held
        return {
            "role": job.role,
            "unsharded": [],
            **counts,
            "bytes": kinds,
            "peak": named.get("Total", 0.0) + held,
            "reference": held,
            "tracked": named,
        }
    finally:
        dist.destroy_process_group()


def _token_logprobs(model: Any, ids: Any, chunk: int | None) -> Any:
    """The logprobs of ``ids`` as the training and logprob passes read them (rlfleet's own
    ``token_logprobs``: whole logits, or ``policy.logprob_chunk_size`` tokens at a time)."""
    import torch

    from rlfleet.policy.logprobs import token_logprobs

    return token_logprobs(model, ids, torch.ones_like(ids), chunk=chunk)


def _local_bytes(model: Any) -> int:
    """Bytes of this rank's shards of ``model``'s parameters and buffers."""
    from torch.distributed.tensor import DTensor

    tensors = [*model.parameters(), *model.buffers()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return int(sum(t.numel() * t.element_size() for t in local))


def _parameter_counts(model: Any) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    total = sum(p.numel() for p in model.parameters())  # DTensor numel: the global size
    here = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return {"parameters": int(total), "parameters_here": int(here)}


def rehearse(cfg: MasterConfig) -> list[dict[str, Any]]:
    """Every rank role of ``cfg`` rehearsed, each in a process of its own (a fake world is one per
    process), within :data:`RANK_TIMEOUT_S` each.

    Raises:
        UserError: a rank's rehearsal failed, timed out, or found weights the tensor-parallel plan misses.
    """
    layout = resource_layout(cfg)
    results = []
    for job in rank_jobs(cfg, layout):
        results.append(_run_rank_process(job))
    for result in results:
        if result["unsharded"]:
            raise UserError(
                f"{result['role']}: the tensor-parallel plan leaves these linear weights whole on every rank "
                f"(each rank would hold all of them): {', '.join(result['unsharded'][:8])}"
                + (f" and {len(result['unsharded']) - 8} more" if len(result["unsharded"]) > 8 else "")
                + "; fix: add their projections to rlfleet.policy.parallelize's plan, or "
                "policy.dtensor_cfg.tensor_parallel_size=1"
            )
    return results


def _run_rank_process(job: RankJob) -> dict[str, Any]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the rank is a CPU process whatever this machine has
    command = [sys.executable, "-m", "rlfleet.runtime.rehearse", json.dumps(asdict(job))]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=RANK_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"{job.role}: the rehearsal did not finish within {RANK_TIMEOUT_S:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise UserError(f"{job.role}: the rehearsal failed (exit code {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ------------------------------------------------------------------------------------------------- report


def plan_estimate(cfg: MasterConfig, layout: ResourceLayout) -> float | None:
    """``plan``'s estimate of one training rank's peak (bytes); None without an architecture."""
    from rlfleet.memory.planner import memory_plan, parameter_counts, pass_tokens, resolve_batching

    if cfg.policy.architecture is None:
        return None
    spec = algorithm_spec(cfg.algorithm or "grpo")
    parameters, trainable = parameter_counts(cfg)
    tokens = pass_tokens(cfg, resolve_batching(cfg, layout, spec.name))
    plan = memory_plan(cfg, layout, parameters, trainable, tokens=tokens, algorithm=spec.name)
    return plan.rank_peak()


def generation_rows(cfg: MasterConfig, layout: ResourceLayout) -> list[tuple[str, str]]:
    """The generation engines from the model's real configuration: vLLM's tensor-parallel divisibility,
    weights per GPU, and the KV-cache tokens and sequences that fit at ``gpu_memory_utilization``."""
    config = load_model_config(cfg.policy.model_name)
    text = config.get_text_config()
    tp = layout.gen_tp
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    problems = [
        f"{name} {value} not divisible by TP {tp}"
        for name, value in (("attention heads", heads), ("KV heads", kv_heads))
        if value % tp
    ]
    rows = [("generation TP", f"{tp}: " + ("; ".join(problems) if problems else "heads and KV heads divide"))]
    model = _meta_model(config)
    parameters = int(sum(p.numel() for p in model.parameters()))
    weights = 2 * parameters / tp  # bfloat16
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    vllm = cfg.policy.generation.vllm_cfg
    max_len = vllm.max_model_len or cfg.policy.max_total_sequence_length
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    per_token = 0.0  # KV bytes per token of context, averaged over a max_model_len sequence
    for kind in layer_types:
        held = min(window, max_len) if kind == "sliding_attention" and window else max_len
        per_token += 2 * (kv_heads / tp) * head_dim * 2 * held / max_len  # K and V, bfloat16
    rows.append(
        ("weights per GPU", f"{weights / GB:.1f} GB ({parameters / 1e9:.2f}B parameters, bf16, / TP {tp})")
    )
    for gpu, memory in GPU_MEMORY_GB.items():
        free = memory * GB * vllm.gpu_memory_utilization - weights
        tokens = max(free, 0.0) / per_token
        samples = algorithm_spec(cfg.algorithm or "grpo").settings(cfg).step_rows
        rows.append(
            (
                f"KV cache on {gpu}",
                f"{max(free, 0) / GB:.1f} GB: {tokens:,.0f} tokens, {int(tokens // max_len):,} sequences of "
                f"{max_len} at once (the step samples {samples:,})",
            )
        )
    if not layout.colocated:
        rows.append(("refit per step", _refit_plan(model)))
    return rows


def _refit_plan(model: Any) -> str:
    """The buckets a dedicated engine's refit broadcasts after each step's update (rlfleet's one grouping
    rule, ``rlfleet.generation.weights.bucket_runs``, over the weights in transfer order, in bfloat16)."""
    import torch

    from rlfleet.generation.weights import BUCKET_BYTES, bucket_runs, weight_spec

    spec = weight_spec(model.state_dict(), torch.bfloat16)
    runs = list(bucket_runs(spec.tensors, spec.dtype))
    sizes = [2 * sum(math.prod(shape) for _, shape in run) for run in runs]
    return (
        f"{len(runs)} buckets (at most {BUCKET_BYTES / 2**20:.0f} MiB each unless one tensor is larger; the "
        f"largest {max(sizes) / GB:.2f} GB), {sum(sizes) / GB:.1f} GB broadcast from training rank 0"
    )


def _meta_model(config: Any) -> Any:
    """The causal LM ``config`` builds (a multimodal model's vision tower included), on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def format_rehearsal(cfg: MasterConfig, recipe: str, results: list[dict[str, Any]]) -> str:
    layout = resource_layout(cfg)
    estimate = plan_estimate(cfg, layout)
    lines = [
        f"rehearsal of {recipe}: {layout.train_world} training rank(s), fake process group, fake tensors"
    ]
    header = (
        f"  {'rank':<44}{'params':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'peak':>9}{'plan':>9}{'ratio':>7}"
    )
    lines += [header, "  " + "-" * (len(header) - 2)]
    for r in results:
        b = r["bytes"]
        plan = f"{estimate / GB:.1f}" if estimate else "-"
        ratio = f"{r['peak'] / estimate:.2f}" if estimate else "-"
        cells = "".join(f"{b[k] / GB:>9.1f}" for k in ("parameters", "gradients", "optimizer", "activations"))
        lines.append(f"  {r['role']:<44}{cells}{r['peak'] / GB:>9.1f}{plan:>9}{ratio:>7}")
        held = r["parameters_here"] / 1e9
        lines.append(
            f"    {r['parameters'] / 1e9:.2f}B parameters in the model, {held:.2f}B held by this rank"
        )
        fits = ", ".join(
            f"{gpu} {memory:.0f} GB: {'fits' if r['peak'] <= memory * GB else 'does NOT fit'}"
            for gpu, memory in GPU_MEMORY_GB.items()
        )
        lines.append(f"    {fits}")
    lines.append("  (GB = 10^9 bytes; ratio = rehearsed peak / plan's estimate)")
    for key, value in generation_rows(cfg, layout):
        lines.append(f"  {key:<20}{value}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run_rank(RankJob(**json.loads(sys.argv[1])))), flush=True)
