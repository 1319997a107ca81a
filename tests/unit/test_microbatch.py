"""Micro-batch planning (pure): fixed rows, dynamic batching, bin packing, equal counts across ranks; the
config keys that choose it and their cross-field checks."""

from __future__ import annotations

import pytest
import torch

from rlfleet.config import ConfigError, MasterConfig, check_config
from rlfleet.config.batching import (
    Pass,
    ResolvedBatching,
    TokenBudget,
    recipe_batching,
    token_budget_section,
)
from rlfleet.policy.batch import collate
from rlfleet.policy.logprobs import pack_rows
from rlfleet.policy.microbatch import (
    MicroBatching,
    concatenative,
    dynamic_batches,
    first_fit_decreasing,
    modified_first_fit_decreasing,
    packed_width,
    padding_fraction,
    plan_micro_batches,
    split_to_count,
)
from rlfleet.policy.packed_attention import sequence_bounds
from rlfleet.runtime.components import micro_batching

LENGTHS = [9, 3, 12, 5, 7, 2, 11, 4]


def _flat(groups: list[list[int]]) -> list[int]:
    return sorted(i for g in groups for i in g)


def test_first_fit_decreasing_fills_bins_longest_first() -> None:
    bins = first_fit_decreasing(LENGTHS, 16)
    assert bins == [[2, 7], [6, 3], [0, 4], [1, 5]]  # 12+4, 11+5, 9+7, 3+2
    assert _flat(bins) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 16 for b in bins)


def test_modified_first_fit_decreasing() -> None:
    # two large rows open bins; no medium; the small pair does not fit; the greedy pass fills by size
    assert modified_first_fit_decreasing([6, 6, 3, 3, 1, 1], 10) == [[0, 2, 4], [1, 3, 5]]
    # each large row takes the longest medium row that fits
    assert modified_first_fit_decreasing([12, 7, 11, 8], 20) == [[0, 3], [2, 1]]
    # backward, a large bin without a medium row takes the shortest small row and the longest that fits
    # beside it; the greedy pass gives the tiny rows to the first bin with room
    assert modified_first_fit_decreasing([11, 5, 4, 3, 3, 2, 12], 20) == [[6, 3, 4, 5], [0, 2, 1]]
    # 9 is medium and joins 11; the small pair does not fit beside 12; what fits nowhere goes FFD
    assert modified_first_fit_decreasing([11, 5, 4, 3, 3, 2, 12, 9], 20) == [[6, 1, 3], [0, 7], [2, 4, 5]]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(
            1, 65, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen
        ).tolist()
        bins = modified_first_fit_decreasing(lengths, 64)
        assert _flat(bins) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 64 for b in bins)


def test_concatenative_keeps_order() -> None:
    assert concatenative(LENGTHS, 16) == [[0, 1], [2], [3, 4, 5], [6, 7]]


def test_dynamic_batches_sort_and_respect_the_rounded_budget() -> None:
    groups = dynamic_batches(LENGTHS, 32, round_to=8)
    # longest first; 12 -> 16 wide: 2 rows; 9 -> 16: 2 rows; 5 -> 8: 4 rows
    assert groups == [[2, 6], [0, 4], [3, 7, 1, 5]]
    for g in groups:
        width = -(-max(LENGTHS[i] for i in g) // 8) * 8
        assert len(g) * width <= 32


def test_fixed_rows_keep_batch_order() -> None:
    assert plan_micro_batches(LENGTHS, MicroBatching(rows=3)) == [[[0, 1, 2], [3, 4, 5], [6, 7]]]


@pytest.mark.parametrize(
    "batching",
    [
        MicroBatching(rows=2),
        MicroBatching(rows=2, tokens=24, round_to=4),
        MicroBatching(rows=2, tokens=14, pack=True),
    ],
)
def test_every_shard_gets_as_many_micro_batches(batching: MicroBatching) -> None:
    lengths = [12, 12, 11, 10, 2, 1, 3, 2]  # shard 0 long rows, shard 1 short ones
    plans = plan_micro_batches(lengths, batching, num_shards=2)
    assert len(plans[0]) == len(plans[1])
    for plan in plans:
        assert _flat(plan) == [0, 1, 2, 3]  # indices into the shard's own rows, each once


def test_split_to_count_splits_the_largest_group() -> None:
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches from 2 rows"):
        split_to_count([[0], [1]], 3)


def test_a_sequence_longer_than_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit the micro-batch token budget of 8"):
        plan_micro_batches([9, 2], MicroBatching(rows=1, tokens=8, pack=True))
    with pytest.raises(ValueError, match="token budget of 10"):  # 9 rounds up to 12
        plan_micro_batches([9, 2], MicroBatching(rows=1, tokens=10, round_to=4))


def test_padding_fraction_per_layout() -> None:
    lengths = [8, 2, 8, 3]
    rows = MicroBatching(rows=2)  # [8, 2] [8, 3]: 2 x 8 + 2 x 8 slots
    assert padding_fraction(lengths, plan_micro_batches(lengths, rows)[0], rows) == pytest.approx(1 - 21 / 32)
    dyn = MicroBatching(rows=2, tokens=16)  # [8, 8] [3, 2]: 2 x 8 + 2 x 3 slots
    assert padding_fraction(lengths, plan_micro_batches(lengths, dyn)[0], dyn) == pytest.approx(1 - 21 / 22)
    packed = MicroBatching(rows=2, tokens=11, pack=True)
    assert padding_fraction(lengths, plan_micro_batches(lengths, packed)[0], packed) == 0.0
    long = [40, 30]  # one packed row of 70 tokens runs at 72 (a multiple of 4 between 64 and 128)
    packed = MicroBatching(rows=2, tokens=100, pack=True)
    assert padding_fraction(long, plan_micro_batches(long, packed)[0], packed) == pytest.approx(1 - 70 / 72)


def test_packed_width_is_on_a_short_list_within_a_sixteenth() -> None:
    assert [packed_width(n, None) for n in (1, 17, 31, 32, 33, 63, 64, 65, 1000, 1025)] == [
        1,
        17,
        31,
        32,
        34,
        64,
        64,
        68,
        1024,
        1088,
    ]
    widths = {packed_width(n, None) for n in range(4097, 8193)}
    assert len(widths) == 16 and widths == set(range(4096 + 256, 8192 + 1, 256))
    for n in range(1, 20000, 7):
        assert n <= packed_width(n, None) <= n * 17 / 16
    assert packed_width(9000, 9100) == 9100  # never past the budget
    assert packed_width(9200, 9100) == 9200  # unless the real tokens already are
    assert packed_width(9000, None) == packed_width(9000, 20000) == 9216


def test_pack_rows_restarts_positions_per_sequence() -> None:
    batch = collate([[5, 6], [7], [8, 9, 10]], [[11], [12, 13], [14]], pad_token_id=0)
    packed, positions, rows, cols = pack_rows(batch.input_ids, batch.attention_mask)
    assert packed.tolist() == [[5, 6, 11, 7, 12, 13, 8, 9, 10, 14]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3]]
    assert rows.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert torch.equal(batch.input_ids[rows, cols], packed[0])


def test_pack_rows_pads_with_a_sequence_of_its_own() -> None:
    batch = collate([[5, 6], [7]], [[11], [12, 13]], pad_token_id=0)
    packed, positions, rows, cols = pack_rows(batch.input_ids, batch.attention_mask, width=9)
    assert packed.tolist() == [[5, 6, 11, 7, 12, 13, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2]]  # the padding restarts at 0
    assert len(rows) == len(cols) == 6
    assert sequence_bounds(positions, 9) == [(0, 3), (3, 6), (6, 9)]


def test_take_gathers_rows_in_any_order_and_trims_padding() -> None:
    batch = collate([[5, 6], [7], [8, 9, 10]], [[11], [12, 13], [14]], pad_token_id=0)
    sub = batch.take([1, 0])
    assert sub.input_ids.tolist() == [[7, 12, 13], [5, 6, 11]]
    assert sub.response_mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]


def _cfg(*overrides: str) -> MasterConfig:
    from rlfleet.config.loader import validate_config

    raw: dict = {"policy": {"model_name": "x", "max_total_sequence_length": 128}}
    for item in overrides:
        key, value = item.split("=")
        section, name = key.split(".")
        raw["policy"].setdefault(section, {})[name] = int(value) if value.isdigit() else value == "true"
    return validate_config(raw)


def _batching(cfg: MasterConfig, pass_: Pass) -> MicroBatching:
    return micro_batching(cfg, pass_, recipe_batching(cfg.policy))


def test_micro_batching_from_config_and_its_defaults() -> None:
    assert _batching(_cfg(), "train") == MicroBatching(rows=8)
    packed = _cfg("sequence_packing.enabled=true", "sequence_packing.logprob_mb_tokens=300")
    assert _batching(packed, "train") == MicroBatching(rows=8, tokens=128 * 8, pack=True)
    assert _batching(packed, "logprob") == MicroBatching(rows=16, tokens=300, pack=True)
    dyn = _cfg("dynamic_batching.enabled=true", "dynamic_batching.sequence_length_round=32")
    assert _batching(dyn, "logprob") == MicroBatching(rows=16, tokens=128 * 16, round_to=32)


def test_one_function_says_which_token_budget_applies() -> None:
    assert token_budget_section(_cfg().policy) is None
    assert token_budget_section(_cfg("dynamic_batching.enabled=true").policy) == "dynamic_batching"
    packed = _cfg("sequence_packing.enabled=true", "sequence_packing.train_mb_tokens=512")
    assert token_budget_section(packed.policy) == "sequence_packing"
    resolved = recipe_batching(packed.policy)
    assert resolved.budget("train") == TokenBudget(512, "set by the recipe")
    assert resolved.budget("logprob") == TokenBudget(
        128 * 16, "max_total_sequence_length x logprob_batch_size"
    )
    assert resolved.fitted() == {}
    assert recipe_batching(_cfg().policy) == ResolvedBatching(None)
    with pytest.raises(KeyError, match="no token budget resolved for the logprob pass"):
        micro_batching(packed, "logprob", recipe_batching(packed.policy, ("train",)))


def test_both_modes_at_once_and_small_budgets_are_refused() -> None:
    both = _cfg("dynamic_batching.enabled=true", "sequence_packing.enabled=true")
    with pytest.raises(ConfigError, match="set one of them to false"):
        check_config(both, "sft")
    small = _cfg(
        "dynamic_batching.enabled=true",
        "dynamic_batching.train_mb_tokens=130",
        "dynamic_batching.sequence_length_round=96",
    )
    with pytest.raises(ConfigError) as err:
        check_config(small, "sft")
    assert "policy.dynamic_batching.train_mb_tokens=130 is smaller than the longest sequence" in str(
        err.value
    )
    assert "fix: policy.dynamic_batching.train_mb_tokens=192" in str(err.value)  # 128 rounded up to 96


def test_sequence_bounds_of_a_packed_row() -> None:
    assert sequence_bounds(torch.tensor([[0, 1, 2, 0, 1, 0]]), 6) == [(0, 3), (3, 5), (5, 6)]
    assert sequence_bounds(torch.tensor([[0, 1, 2, 3]]), 4) is None  # one sequence: plain sdpa
    assert sequence_bounds(torch.tensor([[0, 1, 0], [0, 1, 2]]), 3) is None  # padded rows
    assert sequence_bounds(None, 3) is None
