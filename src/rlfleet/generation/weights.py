"""The one path of the trainer's weights to the generation engines.

What an engine loads is always the same: ``engine_state``, the trainer's full float32 weights with any LoRA
adapters merged into their base weights (base names only), cast to the engine's dtype and grouped into
buckets of at most ``BUCKET_BYTES`` (``bucket_runs``, the one grouping rule: consecutive tensors in transfer
order, the state's own in process and colocated, sorted by name on the dedicated path; a single larger
tensor is a bucket of its own). Every path ends in the engine's ``load_buckets``:
the HF engine copies each tensor into its module in place, the vLLM engine writes each bucket to a
safetensors file and reloads them all (:mod:`rlfleet.generation.vllm`). Three transports take them there::

  1. in process (GenerationBackend.refit, after every optimizer step)
       trainer model --engine_state--> buckets --> VLLMGenerationBackend.load_buckets
       (HFGenerationBackend samples with the trainer's own module: nothing moves)

  2. Ray, colocated (RayGeneration.refit --> ShardedPolicyRank.refit on every training rank)
       FSDP2 shards --gather (all ranks)--> engine_state --> GenerationRank.update_weights
         --> buckets --> backend.load_buckets                 (on the ranks that host an engine)

  3. Ray, dedicated (RayGeneration: weight_spec + join_refit_group once, then broadcast_weights)
       training rank 0, ShardedPolicyRank.broadcast_weights(spec):
         FSDP2 shards --gather (all ranks)--> engine_state --> buckets --> RefitGroup.send
                                                                             || one flat tensor per
       generation ranks 1..N, GenerationRank.broadcast_weights(spec):      ||  bucket (NCCL/gloo)
         backend.load_buckets <-- RefitGroup.receive <=========================

The vocabulary, the same on every class that takes part:

* ``refit()``: make the engines use the trainer's current weights (the generation backends, the driver's
  ``RayGeneration``, and a colocated training rank for its own engine);
* ``weight_spec()``: a ``WeightSpec``, the names and shapes in transfer order and the dtype this end holds
  them in (a training rank: float32; an engine: its precision). Before the first dedicated refit both ends'
  names and shapes are checked equal and the refit's spec is the trainer's tensors in the engines' dtype, so
  a bucket can never be misread;
* ``join_refit_group(master_addr, master_port, rank, size, timeout_s)``: join the dedicated path's
  broadcast group (``RefitGroup``: training rank 0 is rank 0, generation rank ``i`` is ``i + 1``);
* ``broadcast_weights(spec)``: the dedicated transfer, called on both ends like any collective (rank 0
  sends, the others receive; the other training ranks help gather);
* ``update_weights(state)``: full tensors into a generation worker's engine (the colocated path's end);
* ``load_buckets(buckets)``: what every path ends in, on the engine backends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from rlfleet.models.lora import has_adapters, merge_adapters, model_scaling

BUCKET_BYTES = 256 * 1024**2  # largest bucket: one broadcast, or one safetensors file for a vLLM engine

TensorShapes = Sequence[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class WeightSpec:
    """The tensors a refit moves and their dtype.

    Attributes:
        tensors: ``(name, shape)`` of every weight, in transfer order (sorted by name).
        dtype: What the weights are held in at the end that gave the spec; a refit's spec holds the dtype
            they travel in (the engines').
    """

    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype


def weight_spec(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> WeightSpec:
    """``state``'s names and shapes in transfer order (sorted by name), held in ``dtype``."""
    return WeightSpec(tuple((name, tuple(state[name].shape)) for name in sorted(state)), dtype)


def engine_state(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What the engines load: ``model``'s full weights with any LoRA adapters merged in, ``W + s B A``
    computed in float32 (base names only, no adapter keys).

    Args:
        model: The trainer's model (its adapters give the LoRA scaling).
        state: ``model``'s full state dict, gathered from its shards (empty on a rank that gathers
            nothing); None reads ``model.state_dict()``.

    Returns:
        The state itself when there is nothing to merge.
    """
    full = model.state_dict() if state is None else state
    if not full or not has_adapters(model):
        return full
    return merge_adapters(full, model_scaling(model))


def bucket_runs(
    tensors: Iterable[tuple[str, tuple[int, ...]]], dtype: torch.dtype, limit: int = BUCKET_BYTES
) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive runs of ``tensors``, in their order, of at most ``limit`` bytes in ``dtype`` (a larger
    single tensor is a run of its own). Sender and receivers compute the same runs from the same spec."""
    element = torch.empty((), dtype=dtype).element_size()
    run: list[tuple[str, tuple[int, ...]]] = []
    size = 0
    for name, shape in tensors:
        nbytes = element * math.prod(shape)
        if run and size + nbytes > limit:
            yield run
            run, size = [], 0
        run.append((name, shape))
        size += nbytes
    if run:
        yield run


def buckets(
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    order: TensorShapes | None = None,
    device: torch.device | str = "cpu",
    limit: int = BUCKET_BYTES,
) -> Iterator[dict[str, torch.Tensor]]:
    """``state`` cast to ``dtype``, grouped by ``bucket_runs``: one ``{name: tensor}`` dict per bucket.

    Pass every name, tied weights included (``model.state_dict()`` lists them under each name): vLLM's CPU
    build keeps a repacked copy of a tied ``lm_head``, which a refit without ``lm_head.weight`` would leave
    stale. Each tensor is a contiguous copy on ``device`` (safetensors refuses shared storage), made as its
    bucket is reached, so one bucket at a time is held.

    Args:
        state: Full tensors by name.
        dtype: What they travel in.
        order: The names (and shapes) in transfer order; None: ``state``'s own order.
        device: Where the copies go (the CPU for files and broadcasts, an HF engine's own device).
        limit: Largest bucket in bytes.
    """
    tensors = order if order is not None else [(name, tuple(value.shape)) for name, value in state.items()]
    for run in bucket_runs(tensors, dtype, limit):
        yield {name: state[name].detach().to(device, dtype, copy=True).contiguous() for name, _ in run}


def check_complete(spec: WeightSpec, state: Mapping[str, torch.Tensor]) -> None:
    """Raises ``KeyError`` unless ``state`` holds every tensor of ``spec`` (before anything is loaded)."""
    missing = sorted({name for name, _ in spec.tensors} - set(state))
    if missing:
        raise KeyError(f"refit is missing {len(missing)} weight(s), e.g. {missing[:3]}")


class RefitGroup:
    """One member of the dedicated path's broadcast group (rank 0, the trainer, sends; the others receive).

    A *separate* process group spanning training rank 0 and every generation rank, on its own
    ``TCPStore``, so it disturbs neither the trainers' default group (FSDP, DCP) nor the generation
    workers'. NCCL between GPUs, gloo on CPUs.

    Args:
        master_addr: Address of rank 0's store.
        master_port: A free port on rank 0's node.
        rank: This member's rank (0: the trainer).
        size: Members in all (1 + generation ranks).
        timeout_s: Limit on forming the group and on each collective.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        store = dist.TCPStore(master_addr, master_port, world_size=size, is_master=rank == 0, timeout=timeout)
        # torch's stubs give these backends none of the collectives they have (broadcast is all we use)
        # and NCCL's options no default
        if self.device.type == "cuda":
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, size)  # type: ignore[call-arg, assignment]
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[assignment]

    def _broadcast(self, buffer: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buffer], opts).wait()

    def send(self, state: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        """Rank 0: broadcasts ``state`` (full tensors) in ``spec``'s order and dtype, one flat tensor per
        bucket."""
        for bucket in buckets(state, spec.dtype, order=spec.tensors):
            flat = torch.cat([tensor.reshape(-1) for tensor in bucket.values()])
            self._broadcast(flat.to(self.device))

    def receive(self, spec: WeightSpec) -> Iterator[dict[str, torch.Tensor]]:
        """Ranks > 0: yields each received bucket as ``{name: tensor}`` (views of one flat buffer, on this
        member's device); consume every bucket, since each is a collective with the sender."""
        for run in bucket_runs(spec.tensors, spec.dtype):
            sizes = [math.prod(shape) for _, shape in run]
            flat = torch.empty(sum(sizes), dtype=spec.dtype, device=self.device)
            self._broadcast(flat)
            yield {name: part.view(shape) for (name, shape), part in zip(run, flat.split(sizes), strict=True)}

    def close(self) -> None:
        """Drops the group (its store closes with it)."""
        self.group = None  # type: ignore[assignment]
