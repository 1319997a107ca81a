"""Weight refit from the trainer to generation engines.

Dedicated generation workers receive the weights by broadcast over a *separate* process group spanning
trainer rank 0 (the source) and every generation rank. It is built on its own ``TCPStore``, so it does
not disturb the trainers' default group (FSDP, DCP) or the generation workers'. Tensors travel in flat
buckets of one dtype, in the sorted order of their names; both sides check the same names and shapes
before the first refit (``weight_spec``), so a bucket can never be misread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 1024 * 1024

WeightSpec = list[tuple[str, tuple[int, ...]]]


def weight_spec(state: Mapping[str, torch.Tensor]) -> WeightSpec:
    """Names and shapes in transfer order (sorted by name)."""
    return [(name, tuple(state[name].shape)) for name in sorted(state)]


def buckets(spec: WeightSpec, element_size: int, limit: int = BUCKET_BYTES) -> Iterator[WeightSpec]:
    """Consecutive runs of ``spec`` of at most ``limit`` bytes (a larger single tensor is its own run)."""
    run: WeightSpec = []
    size = 0
    for name, shape in spec:
        nbytes = element_size * max(1, int(torch.Size(shape).numel()))
        if run and size + nbytes > limit:
            yield run
            run, size = [], 0
        run.append((name, shape))
        size += nbytes
    if run:
        yield run


class RefitGroup:
    """One member of the refit process group (rank 0 sends, the others receive).

    Args:
        master_addr: Address of rank 0's store.
        master_port: A free port on rank 0's node.
        rank: This member's rank (0: the trainer).
        size: Members in all (1 + generation ranks).
        timeout_s: Limit on forming the group and on each collective.
        dtype: The dtype weights travel in (the generation engines' precision).
    """

    def __init__(
        self, master_addr: str, master_port: int, rank: int, size: int, timeout_s: float, dtype: torch.dtype
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.size, self.dtype = rank, size, dtype
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
        """Rank 0: broadcasts ``state`` (full tensors) bucket by bucket."""
        element = torch.empty((), dtype=self.dtype).element_size()
        for run in buckets(spec, element):
            flat = torch.cat([state[name].detach().reshape(-1).to(self.dtype) for name, _ in run])
            self._broadcast(flat.to(self.device))

    def receive(self, target: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
        """Ranks > 0: receives every bucket and copies each tensor into ``target`` in place."""
        for bucket in self.receive_buckets(spec):
            for name, tensor in bucket.items():
                target[name].copy_(tensor)

    def receive_buckets(self, spec: WeightSpec) -> Iterator[dict[str, torch.Tensor]]:
        """Ranks > 0: yields each received bucket as ``{name: tensor}`` (views of one flat buffer, on this
        member's device); consume every bucket, since each is a collective with the sender."""
        element = torch.empty((), dtype=self.dtype).element_size()
        for run in buckets(spec, element):
            sizes = [int(torch.Size(shape).numel()) for _, shape in run]
            flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
            self._broadcast(flat)
            yield {name: part.view(shape) for (name, shape), part in zip(run, flat.split(sizes), strict=True)}

    def close(self) -> None:
        """Drops the group (its store closes with it)."""
        self.group = None  # type: ignore[assignment]
