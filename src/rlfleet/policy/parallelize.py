"""Tensor parallelism, activation checkpointing and FSDP2 sharding of a Hugging Face causal LM.

The ranks of the default process group form a 2-D ``("dp", "tp")`` mesh (``build_mesh``). ``parallelize``
splits the attention and MLP projections of every decoder layer over ``"tp"`` (Megatron style: q/k/v and
gate/up column-wise, o and down row-wise, so each layer needs one all-reduce after attention and one after
the MLP), optionally checkpoints each decoder layer's activations, and shards all parameters over ``"dp"``
with FSDP2. Embeddings, norms and the LM head are replicated across ``"tp"``. Plain ``torch.distributed``:
whatever starts the ranks (Ray's worker groups in ``rlfleet.distributed``) is not its concern.

Notes on transformers (checked against 5.x):

* The attention modules of Llama, Qwen2/Qwen3, Mistral and Gemma/Gemma2/Gemma3 reshape the projections
  to ``(*input_shape, -1, head_dim)`` and back to ``(*input_shape, -1)``, and ``num_key_value_groups``
  (query heads per key/value head) is the same locally as globally. With the projections' outputs as
  local tensors (``use_local_output=True``), attention therefore runs on this rank's heads unchanged: no
  config attribute has to be rewritten.
* Activation checkpointing wraps each decoder layer's ``forward`` on the instance with non-reentrant
  ``torch.utils.checkpoint``. Unlike ``checkpoint_wrapper`` it keeps parameter names (no
  ``_checkpoint_wrapped_module.`` infix), it does not depend on transformers' checkpointing API (which
  changed within 5.x), and it keeps FSDP2's hooks on the layer outside the checkpoint, so the backward
  pass recomputes the layer with the parameters FSDP2's pre-backward hook has already gathered.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedConfig, PreTrainedModel

# Where decoder layers live, relative to the causal LM (the second: multimodal Gemma3 and the like).
_LAYER_PATHS = ("model.layers", "model.language_model.layers")
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers`` or ``model.model.language_model.layers``).

    Raises:
        ValueError: The model has neither.
    """
    for path in _LAYER_PATHS:
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(
        f"{type(model).__name__}: no decoder layers at {' or '.join(_LAYER_PATHS)}; sharding per decoder "
        "layer supports Llama-, Qwen2/3-, Mistral- and Gemma-style causal LMs"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(config: PreTrainedConfig, tensor_parallel_size: int) -> list[str]:
    """What stops ``config``'s model from being split over ``tensor_parallel_size`` ranks (empty: nothing).

    The query heads, key/value heads and MLP width must each divide evenly by the tensor-parallel size.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tp = tensor_parallel_size
    if tp < 1:
        return [f"tensor_parallel_size must be >= 1, got {tp}"]
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    width = getattr(text, "intermediate_size", None)  # a list where layers differ (e.g. Gemma3n)
    widths = [int(w) for w in width] if isinstance(width, list | tuple) else [int(width or tp)]
    problems = []
    if heads % tp or kv_heads % tp:
        problems.append(
            f"num_attention_heads={heads} and num_key_value_heads={kv_heads} must both divide by it"
        )
    if any(w % tp for w in widths):
        problems.append(f"intermediate_size={width} must divide by it")
    if problems:
        works = _divisors(math.gcd(heads, kv_heads, *widths))
        model_type = getattr(text, "model_type", None) or type(config).__name__
        return [
            f"model_type {model_type!r} cannot use tensor_parallel_size={tp}: "
            + "; ".join(problems)
            + f" (tensor_parallel_size values that work: {works})"
        ]
    return []


def validate_tensor_parallel(model: PreTrainedModel, tensor_parallel_size: int) -> None:
    """Raises ``ValueError`` if ``model`` cannot be split over ``tensor_parallel_size`` ranks.

    Checks that the decoder layers are where ``decoder_layers`` looks, the config (``check_tensor_parallel``)
    and that every decoder layer has the projections the plan names (``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``). Touches nothing.
    """
    layers = decoder_layers(model)
    problems = check_tensor_parallel(model.config, tensor_parallel_size)
    if problems:
        raise ValueError("; ".join(problems))
    for index, layer in enumerate(layers):
        for name in (*_COLWISE, *_ROWWISE):
            try:
                found = layer.get_submodule(name)
            except AttributeError:
                found = None
            if not isinstance(found, nn.Linear):
                raise ValueError(
                    f"{type(model).__name__}: decoder layer {index} ({type(layer).__name__}) has no linear "
                    f"{name}; tensor parallelism supports Llama-, Qwen2/3-, Mistral- and Gemma-style layouts"
                )


def unsharded_linears(model: nn.Module, tensor_parallel_size: int) -> list[str]:
    """The linear weights of the decoder layers that ``parallelize`` left whole on each tensor-parallel rank
    (none when ``tensor_parallel_size`` is 1): a projection the plan misses is replicated on every rank,
    which multiplies its memory by the TP size. Embeddings, norms, the LM head and a vision tower sit
    outside the decoder layers and are replicated on purpose."""
    if tensor_parallel_size <= 1:
        return []
    whole = []
    for index, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and not _split_over_tp(module.weight):
                whole.append(f"layer {index}: {name}")
    return whole


def _split_over_tp(weight: torch.Tensor) -> bool:
    if not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    return any(
        n == "tp" and not isinstance(pl, Replicate) for n, pl in zip(names, weight.placements, strict=True)
    )


def build_mesh(tensor_parallel_size: int, device_type: str) -> DeviceMesh:
    """A ``("dp", "tp")`` mesh over the default process group, ``tp`` innermost.

    Ranks ``r * tp .. r * tp + tp - 1`` form data-parallel replica ``r``'s tensor-parallel group.

    Args:
        tensor_parallel_size: Ranks per tensor-parallel group; must divide the world size.
        device_type: "cpu" or "cuda".

    Raises:
        ValueError: ``tensor_parallel_size`` is not a positive divisor of the world size.
    """
    world = dist.get_world_size()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the {world} ranks of the process "
            f"group; it must be one of {_divisors(world)}"
        )
    shape = (world // tensor_parallel_size, tensor_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: PreTrainedModel) -> PreTrainedModel:
    """Recomputes each decoder layer's activations in the backward pass (non-reentrant); in place.

    The one way activation checkpointing is turned on, sharded or not. Wraps ``forward`` on each layer
    instance, so ``nn.Module.__call__`` (and FSDP2's hooks) stay outside the checkpoint; outside autograd
    (``torch.no_grad``) the layer runs plainly.

    Raises:
        ValueError: No decoder layers where ``decoder_layers`` looks; nothing changed.
    """
    for layer in decoder_layers(model):
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return model


def is_checkpointed(model: PreTrainedModel) -> bool:
    """Whether ``checkpoint_layers`` wrapped ``model``'s decoder layers."""
    return all(
        isinstance(layer.forward, functools.partial) and layer.forward.func is _checkpointed
        for layer in decoder_layers(model)
    )


def parallelize(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool,
    param_dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Tensor-parallel over ``mesh["tp"]``, optionally checkpointed, FSDP2-sharded over ``mesh["dp"]``.

    In place. Every rank must pass the same weights (tensor parallelism takes those of the tp group's first
    rank). The ranks of one tp group must then feed the same inputs; data is split over ``mesh["dp"]``.
    FSDP2 averages gradients over the dp ranks only (tp ranks hold whole gradients of their shards), so a
    loss that is each dp rank's share of a global sum is multiplied by ``mesh["dp"].size()``.

    Args:
        model: A causal LM with decoder layers where ``decoder_layers`` finds them.
        mesh: From ``build_mesh``.
        activation_checkpointing: Recompute each decoder layer's activations in the backward pass.
        param_dtype: Compute dtype of FSDP2's mixed precision (gradients are reduced in float32); None
            computes in the parameters' dtype.

    Returns:
        ``model``.

    Raises:
        ValueError: The model's layout or head counts do not allow ``mesh["tp"].size()``; nothing changed.
    """
    tp = mesh["tp"].size()
    layers = decoder_layers(model)
    if tp > 1:
        validate_tensor_parallel(model, tp)
        plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in _COLWISE}
        plan |= {name: RowwiseParallel() for name in _ROWWISE}
        for layer in layers:
            parallelize_module(layer, mesh["tp"], plan)
    if activation_checkpointing:
        checkpoint_layers(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh["dp"]} | ({"mp_policy": policy} if param_dtype is not None else {})
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _local_square_sum(grad: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's share of ``grad``'s squared L2 norm: summed over all ranks, it gives the squared norm.

    A shard held by several ranks (replicated mesh dims, or copies of a sub-mesh) counts once in total.
    """
    if not isinstance(grad, DTensor):
        squares: torch.Tensor = torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2 / world
        return squares
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    copies = world // grad.device_mesh.size()  # ranks outside the mesh hold the same shards
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if placement.is_replicate():
            copies *= size
    local = grad.to_local()
    squares = torch.linalg.vector_norm(local, dtype=torch.float32).double() ** 2 / copies
    return squares


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """The L2 norm of all gradients over all ranks; scales them to ``max_norm`` when it is larger.

    Works with any mix of plain tensors (identical on every rank), DTensors on the 1-D data-parallel mesh
    and DTensors on the 2-D (dp, tp) mesh, which ``torch.nn.utils.clip_grad_norm_`` refuses. One
    all-reduce in all. Collective when a process group exists: call it on every rank.

    Args:
        parameters: Parameters whose gradients to measure (those without a gradient are skipped).
        max_norm: Clip to this norm (coefficient ``max_norm / (norm + 1e-6)``); None: only measure.

    Returns:
        The norm before clipping, the same float on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    if grads:
        device = grads[0].device
    elif distributed and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        total += _local_square_sum(grad, world).to(device)
    if distributed:
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None and norm > max_norm:
        coefficient = max_norm / (norm + 1e-6)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coefficient)
    return norm
