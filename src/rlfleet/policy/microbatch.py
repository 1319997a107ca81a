"""Micro-batch planning: which rows go through the model together, and in what layout.

Three ways to split the rows of a pass (``MicroBatching``):

* **fixed rows** (``tokens=None``): ``rows`` rows per micro-batch in batch order, padded to the longest;
* **dynamic batching** (``tokens`` set, ``pack=False``): rows sorted by length, longest first, each
  micro-batch filled while ``rows x round_up(longest, round_to) <= tokens`` (NeMo RL's
  ``policy.dynamic_batching``);
* **sequence packing** (``pack=True``): rows bin-packed (``algorithm``) into bins of at most
  ``tokens`` tokens; each bin is one packed row whose sequences restart their ``position_ids`` at 0, so
  the model's attention is block-diagonal causal (NeMo RL's ``policy.sequence_packing``).

With ``pairs`` (DPO's chosen and rejected responses, rows ``2i`` and ``2i + 1``) each pair is planned as one
unit, so both rows of a pair go through the model in the same micro-batch, on the same rank, side by side
(a loss that compares them sees both): ``rows`` counts rows (two per pair), and a pair is two rows of its
longer length under dynamic batching, and its two lengths' sum when packed.

The model sees the compact layout; the logprobs are scattered back to the padded ``[n, T]`` rows of the
micro-batch before the loss, so loss functions, the global ``Normalizer`` and the restored row order are the
same whatever the layout, and so are the loss and the gradients (up to float rounding).

Under data parallelism every rank plans every rank's share of the rows (each rank holds the whole batch), so
all ranks agree on the number of forward passes (FSDP needs them equal) without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from rlfleet.policy.batch import TrainBatch
from rlfleet.policy.loss_math import Normalizer
from rlfleet.utils.intmath import round_up

# A packed row runs at a width from a short list: its real tokens rounded up to one of 16 widths per
# doubling (``packed_width``), the rest one sequence of padding that no real token attends to. oneDNN and
# ideep keep a compiled CPU matmul primitive per shape (several per new width: forward and both gradients of
# each linear shape, plus the logprob chunks), so a new width every step grew the trainer step after step
# (issue 20); on the list, the widths of a run's steps repeat. It costs at most 1/16 of the row in padding.
PACKED_WIDTHS_PER_DOUBLING = 16

PackingAlgorithm = Literal["first_fit_decreasing", "modified_first_fit_decreasing", "concatenative"]


@dataclass(frozen=True)
class MicroBatching:
    """How one pass (logprobs or training) splits its rows into forward passes.

    Attributes:
        rows: Rows per micro-batch when ``tokens`` is None (``policy.train_micro_batch_size`` /
            ``policy.logprob_batch_size``).
        tokens: Token budget of a micro-batch (padding included), or None for fixed rows.
        pack: Concatenate the rows of a micro-batch into one packed row (needs ``tokens``).
        round_to: Dynamic batching pads each micro-batch to its longest row rounded up to a multiple of this.
        algorithm: How rows are bin-packed when ``pack``.
        logprob_chunk: Tokens per chunk of the logprob computation from the final hidden states (no
            ``[tokens x vocabulary]`` logits; ``policy.logprob_chunk_size``), or None for whole logits.
        pairs: Rows ``2i`` and ``2i + 1`` stay together, in that order (DPO's chosen and rejected).
    """

    rows: int
    tokens: int | None = None
    pack: bool = False
    round_to: int = 1
    algorithm: PackingAlgorithm = "first_fit_decreasing"
    logprob_chunk: int | None = None
    pairs: bool = False

    def __post_init__(self) -> None:
        optional = (self.tokens, self.logprob_chunk)
        if self.rows < 1 or self.round_to < 1 or any(n is not None and n < 1 for n in optional):
            raise ValueError(f"micro-batching needs positive sizes, got {self}")
        if self.pack and self.tokens is None:
            raise ValueError("sequence packing needs a token budget (MicroBatching.tokens)")
        if self.pairs and self.tokens is None and self.rows < 2:
            raise ValueError(f"a micro-batch of pairs needs at least 2 rows, got {self.rows}")

    @property
    def name(self) -> str:
        return "packed" if self.pack else "dynamic" if self.tokens is not None else "rows"


def as_micro_batching(value: MicroBatching | int) -> MicroBatching:
    """A row count means fixed micro-batches of that many rows."""
    return value if isinstance(value, MicroBatching) else MicroBatching(rows=value)


# ------------------------------------------------------------------------------------------ pure planning


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths`` (longest first, each into the first bin it fits), sum <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fit = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if fit is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[fit].append(i)
            room[fit] -= lengths[i]
    return bins


def concatenative(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of consecutive indices, a new bin whenever the next row would overflow ``capacity``."""
    bins: list[list[int]] = []
    used = capacity
    for i, length in enumerate(lengths):
        if used + length > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += length
    return bins


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Johnson and Garey's modified first-fit decreasing (NeMo RL's default packer).

    Rows are large (> C/2), medium (> C/3), small (> C/6) or tiny. Each large row opens a bin (longest
    first); forward over the bins, each takes the longest medium row that fits; backward over the bins
    without a medium row, each takes the shortest small row plus the longest small row that fits beside
    it; forward again, each bin takes the longest remaining rows that fit; what is left is packed by
    first-fit decreasing into new bins. Ties keep batch order.
    """
    by_size = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in batch order
    large = [i for i in by_size if lengths[i] * 2 > capacity]
    medium = [i for i in by_size if capacity < lengths[i] * 3 and lengths[i] * 2 <= capacity]
    small = [i for i in reversed(by_size) if capacity < lengths[i] * 6 and lengths[i] * 3 <= capacity]
    bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]
    for b in range(len(bins)):
        fit = next((i for i in medium if lengths[i] <= room[b]), None)
        if fit is not None:
            medium.remove(fit)
            bins[b].append(fit)
            room[b] -= lengths[fit]
    with_medium = {b for b in range(len(bins)) if len(bins[b]) > 1}
    for b in reversed(range(len(bins))):
        if b in with_medium or len(small) < 2 or lengths[small[0]] + lengths[small[1]] > room[b]:
            continue
        first = small.pop(0)
        second = next(i for i in reversed(small) if lengths[first] + lengths[i] <= room[b])
        small.remove(second)
        bins[b] += [first, second]
        room[b] -= lengths[first] + lengths[second]
    placed = {i for group in bins for i in group}
    rest = [i for i in by_size if i not in placed]
    for b in range(len(bins)):
        while (fit := next((i for i in rest if lengths[i] <= room[b]), None)) is not None:
            rest.remove(fit)
            bins[b].append(fit)
            room[b] -= lengths[fit]
    leftovers = first_fit_decreasing([lengths[i] for i in rest], capacity)
    return bins + [[rest[j] for j in group] for group in leftovers]


PACKERS = {
    "first_fit_decreasing": first_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "concatenative": concatenative,
}


def fixed_rows(num_rows: int, rows: int) -> list[list[int]]:
    """Consecutive groups of ``rows`` rows (the last may be shorter)."""
    return [list(range(i, min(i + rows, num_rows))) for i in range(0, num_rows, rows)]


def dynamic_batches(lengths: Sequence[int], tokens: int, round_to: int) -> list[list[int]]:
    """Rows sorted longest first, grouped while ``rows x round_up(longest, round_to) <= tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * width <= tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = round_up(lengths[i], round_to)
    return groups


def _check_fits(lengths: Sequence[int], batching: MicroBatching) -> None:
    if batching.tokens is None or not lengths:
        return
    longest = max(lengths) if batching.pack else round_up(max(lengths), batching.round_to)
    if longest > batching.tokens:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens does not fit the micro-batch token budget of "
            f"{batching.tokens} ({batching.name}); fix: raise policy.dynamic_batching / "
            "policy.sequence_packing train_mb_tokens and logprob_mb_tokens to at least "
            "policy.max_total_sequence_length (rounded up to sequence_length_round)"
        )


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """Splits the largest groups in two until there are ``count`` (needs ``count`` <= number of rows)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {sum(map(len, groups))} rows")
        groups[largest : largest + 1] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return groups


def plan_micro_batches(
    lengths: Sequence[int], batching: MicroBatching, num_shards: int = 1
) -> list[list[list[int]]]:
    """The micro-batches of each shard, as row indices into that shard's share.

    ``lengths`` are the token counts of all rows; shard ``s`` owns the contiguous rows
    ``[s * n, (s + 1) * n)`` with ``n = len(lengths) // num_shards``. Every shard gets the same number of
    micro-batches (its largest ones split where needed), so data-parallel ranks run equal forward passes.
    """
    if batching.pairs:
        return plan_pairs(lengths, batching, num_shards)
    if len(lengths) % num_shards:
        raise ValueError(f"{len(lengths)} rows do not split evenly over {num_shards} shards")
    _check_fits(lengths, batching)
    share = len(lengths) // num_shards
    plans = []
    for s in range(num_shards):
        mine = list(lengths[s * share : (s + 1) * share])
        if batching.tokens is None:
            plans.append(fixed_rows(len(mine), batching.rows))
        elif batching.pack:
            plans.append(PACKERS[batching.algorithm](mine, batching.tokens))
        else:
            plans.append(dynamic_batches(mine, batching.tokens, batching.round_to))
    count = max(len(p) for p in plans)
    return [split_to_count(p, count) for p in plans]


def plan_pairs(lengths: Sequence[int], batching: MicroBatching, num_shards: int = 1) -> list[list[list[int]]]:
    """``plan_micro_batches`` with rows ``2i`` and ``2i + 1`` kept together (``batching.pairs``).

    The pairs are planned as units (fixed rows: ``rows // 2`` pairs; dynamic batching: two rows of the
    pair's longer length, so half the token budget per row slot; packing: the pair's summed length), then
    each pair becomes its two rows, in order."""
    if len(lengths) % (2 * num_shards):
        raise ValueError(
            f"{len(lengths)} rows are not whole (chosen, rejected) pairs on each of {num_shards} shard(s)"
        )
    pair = [(lengths[i], lengths[i + 1]) for i in range(0, len(lengths), 2)]
    if batching.pack:
        units, tokens = [a + b for a, b in pair], batching.tokens
    else:
        units = [max(a, b) for a, b in pair]
        tokens = None if batching.tokens is None else batching.tokens // 2
    need = max(units) if batching.pack else 2 * round_up(max(units), batching.round_to)
    if batching.tokens is not None and need > batching.tokens:
        raise ValueError(
            f"a (chosen, rejected) pair needs {need} tokens in one micro-batch, over the token budget of "
            f"{batching.tokens} ({batching.name}); fix: raise policy.dynamic_batching / "
            "policy.sequence_packing train_mb_tokens to at least twice policy.max_total_sequence_length"
        )
    unit_batching = replace(batching, pairs=False, rows=max(1, batching.rows // 2), tokens=tokens)
    return [
        [[row for p in group for row in (2 * p, 2 * p + 1)] for group in shard]
        for shard in plan_micro_batches(units, unit_batching, num_shards)
    ]


def plan_trained_micro_batches(
    lengths: Sequence[int], trained: Sequence[bool], batching: MicroBatching, num_shards: int = 1
) -> list[list[list[int]]]:
    """``plan_micro_batches`` over the rows that ``trained`` marks (the others carry no gradient and are
    skipped), as row indices into each shard's share.

    Data-parallel ranks must still run equal forward passes: a shard with fewer marked rows than the
    largest shard's micro-batch count takes back its first unmarked rows until it can split that many
    ways (an unmarked row adds exactly nothing). With no marked row anywhere each shard computes its first
    row, so that the step still reports its loss and the optimizer still steps on a gradient (of zeros).
    """
    if len(lengths) % num_shards or len(trained) != len(lengths):
        raise ValueError(f"{len(lengths)} rows ({len(trained)} marks) do not split over {num_shards} shards")
    if batching.pairs:
        if not all(trained):
            raise ValueError("rows planned in pairs are all trained (no row of a pair may be skipped)")
        return plan_pairs(lengths, batching, num_shards)
    share = len(lengths) // num_shards
    mine = [[i for i in range(share) if trained[s * share + i]] for s in range(num_shards)]

    def shard_plan(s: int, rows: list[int]) -> list[list[int]]:
        groups = plan_micro_batches([lengths[s * share + i] for i in rows], batching)[0] if rows else []
        return [[rows[j] for j in g] for g in groups]

    plans = [shard_plan(s, rows) for s, rows in enumerate(mine)]
    count = max(1, max(len(p) for p in plans))
    for s, rows in enumerate(mine):
        if len(rows) < count:
            spare = [i for i in range(share) if not trained[s * share + i]]
            rows = sorted(rows + spare[: count - len(rows)])
            plans[s] = shard_plan(s, rows)
    return [split_to_count(p, count) for p in plans]


def padding_fraction(lengths: Sequence[int], plan: Sequence[Sequence[int]], batching: MicroBatching) -> float:
    """Share of the token slots the model computes that are padding, under ``plan``."""
    real = sum(lengths[i] for group in plan for i in group)
    slots = sum(_slots([lengths[i] for i in group], batching) for group in plan)
    return 1.0 - real / slots if slots else 0.0


def padding_metrics(
    batch: TrainBatch, global_batch_size: int, batching: MicroBatching, num_shards: int
) -> dict[str, float]:
    """Padding share of the training forward passes over ``batch`` (all ranks), as planned by ``batching``
    (``padding_fraction``) and as fixed micro-batches of ``batching.rows`` rows would have it
    (``padding_fraction_fixed_rows``, the layout before dynamic batching / packing); rows that are skipped
    (``trained_rows``) are not computed, so they count in neither."""
    fixed = MicroBatching(rows=batching.rows)
    out = {"padding_fraction": 0.0, "padding_fraction_fixed_rows": 0.0}
    num_steps = len(batch) // global_batch_size
    for start in range(0, len(batch), global_batch_size):
        global_batch = batch.select(start, start + global_batch_size)
        lengths, trained = row_lengths(global_batch), trained_rows(global_batch)
        share = len(lengths) // num_shards
        for key, how in (("padding_fraction", batching), ("padding_fraction_fixed_rows", fixed)):
            plans = plan_trained_micro_batches(lengths, trained, how, num_shards)
            groups = [[s * share + i for i in g] for s, plan in enumerate(plans) for g in plan]
            out[key] += padding_fraction(lengths, groups, how) / num_steps
    return out


def packed_width(real_tokens: int, budget: int | None) -> int:
    """The width a packed row of ``real_tokens`` runs at: rounded up to a multiple of ``2^k /
    PACKED_WIDTHS_PER_DOUBLING``, ``2^k`` the power of two at or below ``real_tokens``, so that widths fall on
    a short list, at most ``1/PACKED_WIDTHS_PER_DOUBLING`` above the real tokens; never past ``budget``
    (unless the real tokens already are)."""
    shift = real_tokens.bit_length() - 1 - (PACKED_WIDTHS_PER_DOUBLING.bit_length() - 1)
    width = round_up(real_tokens, 1 << max(shift, 0))
    return min(width, max(real_tokens, budget)) if budget is not None else width


def _slots(lengths: Sequence[int], batching: MicroBatching) -> int:
    if batching.pack:
        return packed_width(sum(lengths), batching.tokens)
    return len(lengths) * round_up(max(lengths), batching.round_to if batching.tokens is not None else 1)


# ------------------------------------------------------------------------------------ running a micro-batch


def row_lengths(batch: TrainBatch) -> list[int]:
    """Real tokens per row (the batch is right-padded)."""
    return [int(n) for n in batch.attention_mask.sum(dim=1)]


def step_counts(batch: TrainBatch) -> list[float]:
    """``[response tokens, rows, response tokens computed, rows computed]`` of (a rank's share of) one
    global batch: summed over the ranks, the arguments of its ``Normalizer``."""
    trained = torch.tensor(trained_rows(batch), dtype=torch.bool)
    tokens = batch.response_mask.sum(dim=1)
    return [float(tokens.sum()), float(len(batch)), float(tokens[trained].sum()), float(trained.sum())]


def step_normalizer(counts: Sequence[float]) -> Normalizer:
    """The global ``Normalizer`` of one optimizer step from the (summed) ``step_counts``."""
    tokens, rows, trained_tokens, trained_sequences = counts
    return Normalizer(tokens, rows, trained_tokens, trained_sequences)


def computed_rows(batch: TrainBatch, dp_size: int) -> list[int]:
    """The rows a logprob pass computes: the ``trained_rows``, plus the first others where the ``dp_size``
    data-parallel ranks need a count they split evenly (at least one row)."""
    flags = trained_rows(batch)
    rows = [i for i, trained in enumerate(flags) if trained]
    spare = [i for i, trained in enumerate(flags) if not trained]
    missing = -len(rows) % dp_size if rows else dp_size
    return sorted(rows + spare[:missing])


def trained_rows(batch: TrainBatch) -> list[bool]:
    """Which rows the training pass computes: all, unless ``batch.inert`` marks rows whose loss and
    gradient are exactly zero."""
    if batch.inert is None:
        return [True] * len(batch)
    return [not bool(flag) for flag in batch.inert]
