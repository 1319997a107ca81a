"""The one builder of the trainable policy model, in one process or sharded over a device mesh.

The rules, the same on every path (one device or many, CPU or GPU):

* **Master weights are float32.** The trainable model's parameters, its gradients and the AdamW state are
  float32 whatever ``policy.precision`` says: an update of relative size 1e-6 (lr 1e-6) vanishes when added
  to bfloat16 weights (8 significant bits), not to float32 ones.
* **``policy.precision`` is the compute dtype.** On one device the forward passes (training and logprobs)
  run under ``torch.autocast(device_type, dtype=compute)`` (``compute_autocast``); sharded, FSDP2 casts the
  gathered parameters to it (``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)``), on the
  CPU (gloo) as on the GPU.
* **The frozen reference is held in the compute dtype** (it is never updated, so nothing rounds away),
  sharded like the policy but without mixed precision.
* **Activation checkpointing** is the per-decoder-layer non-reentrant wrap (``checkpoint_layers``).
* **LoRA** (``lora`` settings): the adapters are injected into the float32 model before it is sharded, so
  FSDP2 shards each with its decoder layer; only they train (float32, so AdamW's state is theirs alone).
  The base weights stay float32 and frozen (no gradients, no optimizer state): the base path computes
  exactly as without LoRA, and the merge ``W + s B A`` for generation engines runs in float32. The reference
  is the policy with its adapters off (``WithoutAdapters``): no second copy of the weights.

The in-process ``PolicyRank`` is the no-mesh (world size 1) case of ``build_policy_models``; the
``ShardedPolicyRank`` passes its ``("dp", "tp")`` mesh.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from rlfleet.models.loading import DTYPES, ModelSource
from rlfleet.models.lora import LoraSettings, WithoutAdapters, apply_lora
from rlfleet.policy.compile import compile_layers
from rlfleet.policy.parallelize import checkpoint_layers, parallelize
from rlfleet.utils.cpu import cpu_flags, slow_cpu_precision

log = logging.getLogger("rlfleet")

MASTER_DTYPE = torch.float32


@dataclass(frozen=True)
class PolicyModels:
    """What ``build_policy_models`` returns.

    Attributes:
        model: The trainable policy: float32 parameters (FSDP2-sharded when built with a mesh).
        reference: A frozen copy of the initial weights in the compute dtype, the policy with its
            adapters off (LoRA), or None.
        compute_dtype: ``policy.precision`` as a torch dtype.
        autocast_dtype: The dtype forward passes must run under ``torch.autocast`` with
            (``compute_autocast``); None when nothing is to be cast (float32 compute, or FSDP2 casts).
        compiled: Whether the decoder layers are compiled (``rlfleet.policy.compile``).
    """

    model: PreTrainedModel
    reference: PreTrainedModel | WithoutAdapters | None
    compute_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    compiled: bool = False


def compute_autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[None]:
    """``torch.autocast`` on ``device``'s type in ``dtype``; does nothing when ``dtype`` is None or float32.

    Wrap forward passes only (the model call, or ``model.generate``): the loss and ``backward`` run outside.
    """
    if dtype is None or dtype == MASTER_DTYPE:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_policy_models(
    source: ModelSource,
    device: torch.device,
    *,
    activation_checkpointing: bool,
    keep_reference: bool,
    mesh: DeviceMesh | None = None,
    lora: LoraSettings | None = None,
    torch_compile: bool = False,
) -> PolicyModels:
    """Loads the trainable policy with float32 master weights (and optionally a frozen reference).

    Seed torch before calling: every rank of a mesh must build the same weights.

    Args:
        source: Where to load the policy from; ``source.precision`` is the compute dtype.
        device: Where the weights live (this rank's device when sharded).
        activation_checkpointing: Recompute each decoder layer's activations in the backward pass.
        keep_reference: Also build a frozen copy of the initial weights.
        mesh: A ``("dp", "tp")`` mesh (``build_mesh``): tensor-parallel over ``"tp"``, FSDP2-sharded
            over ``"dp"``; None keeps the model whole in this process.
        lora: Train LoRA adapters on the linears it selects (the rest frozen); None trains every weight.
        torch_compile: Compile each decoder layer of the policy and the reference
            (``rlfleet.policy.compile``).

    Returns:
        The models, the compute dtype, and whether forward passes need ``compute_autocast``.
    """
    compute = DTYPES[source.precision]
    cast = compute if compute != MASTER_DTYPE else None
    if device.type == "cpu" and (why := slow_cpu_precision(source.precision, cpu_flags())) is not None:
        log.warning(why)
    model = source.load_model("float32")  # the causal LM, or the reward model (source.reward_model)
    # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
    model.to(device)  # type: ignore[arg-type]
    frozen = freeze_outside_text_decoder(model)
    if frozen:
        log.info("%s: %d parameters outside the text decoder kept frozen", source.model_name, frozen)
    if lora is not None:
        apply_lora(model, lora)
    if torch_compile:  # before checkpointing and sharding wrap the layers
        compile_layers(model)
    if mesh is None:
        if activation_checkpointing:
            checkpoint_layers(model)
    else:
        parallelize(model, mesh, activation_checkpointing=activation_checkpointing, param_dtype=cast)
    reference: PreTrainedModel | WithoutAdapters | None = None
    if keep_reference and lora is not None:
        reference = WithoutAdapters(model)
    elif keep_reference:  # loaded after the policy is sharded, so that a rank never holds two whole copies
        reference = _frozen_reference(source, device, mesh, torch_compile)
    return PolicyModels(
        model, reference, compute, autocast_dtype=cast if mesh is None else None, compiled=torch_compile
    )


def freeze_outside_text_decoder(model: PreTrainedModel) -> int:
    """Freezes what a multimodal checkpoint holds beside its text decoder and output layer (Gemma 3's
    ``Gemma3ForConditionalGeneration``: the vision tower and projector); returns how many parameters.

    Training on text gives those weights no gradient, so they get no optimizer state either; frozen, they
    are also not expected in a checkpoint's optimizer state when a run resumes. They stay in the model, its
    checkpoints and its export, unchanged, so the exported directory loads as the original model did. A
    text-only model (its config is its own text config) and a reward model are left as they are.
    """
    config = getattr(model, "config", None)
    if config is None or config.get_text_config() is config:
        return 0
    output = model.get_output_embeddings()
    if output is None:
        return 0
    kept = {id(p) for p in model.get_decoder().parameters()} | {id(p) for p in output.parameters()}
    frozen = [p for p in model.parameters() if id(p) not in kept]
    for parameter in frozen:
        parameter.requires_grad_(False)
    return sum(p.numel() for p in frozen)


def _frozen_reference(
    source: ModelSource, device: torch.device, mesh: DeviceMesh | None, torch_compile: bool
) -> PreTrainedModel:
    """The initial weights, in eval mode, without gradients, computing exactly as the policy does.

    In one process the policy holds float32 weights and its forward runs under autocast; so does the
    reference (float32, the same autocast), so that before any update the two give the same logprobs to
    the last bit. A reference held in the compute dtype would differ: its embeddings, norms and residual
    stream run in bfloat16 where the policy's run in float32, a per-token offset that DPO's summed log
    ratios and GRPO's KL turn into a bias toward short responses. On a mesh FSDP2 casts the policy's
    weights to the compute dtype for its forward, which a reference loaded in that dtype matches."""
    reference = source.load_model("float32" if mesh is None else None)
    # transformers' @wraps on PreTrainedModel.to hides the bound self from mypy
    reference.to(device)  # type: ignore[arg-type]
    if torch_compile:
        compile_layers(reference)
    if mesh is not None:
        parallelize(reference, mesh, activation_checkpointing=False)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def require_master_dtype(model: torch.nn.Module) -> None:
    """Raises ``TypeError`` unless every trainable parameter of ``model`` is float32."""
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != MASTER_DTYPE})
    if wrong:
        raise TypeError(
            f"trainable parameters in {', '.join(wrong)}: master weights (and so AdamW's state) must be "
            "float32; build the model with rlfleet.policy.build.build_policy_models, which loads float32 "
            "and computes in policy.precision"
        )
