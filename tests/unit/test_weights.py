"""The weight path's pieces (``rlfleet.generation.weights``): the one bucketing rule, the cast, and the
broadcast's encoding (sender and receiver compute the same buckets from the same spec)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlfleet.generation.weights import RefitGroup, bucket_runs, buckets, check_complete, weight_spec


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "z.weight": torch.randn(4, 8),  # 128 bytes in float32
        "a.weight": torch.randn(10, 8),  # 320: over the 200-byte limit below, alone
        "m.bias": torch.randn(8),  # 32
        "b.scale": torch.randn(()),  # a scalar: 4
    }


def test_bucket_runs_are_consecutive_within_the_limit_and_a_large_tensor_is_alone() -> None:
    spec = [(name, tuple(t.shape)) for name, t in _state().items()]
    runs = list(bucket_runs(spec, torch.float32, limit=200))
    assert [[name for name, _ in run] for run in runs] == [["z.weight"], ["a.weight"], ["m.bias", "b.scale"]]
    halves = list(bucket_runs(spec, torch.bfloat16, limit=200))  # sizes in the dtype the weights travel in
    assert [[name for name, _ in run] for run in halves] == [["z.weight"], ["a.weight", "m.bias", "b.scale"]]


def test_buckets_cast_copies_in_the_state_order_or_the_order_given() -> None:
    state = _state()
    got = list(buckets(state, torch.bfloat16, limit=200))
    assert [list(b) for b in got] == [["z.weight"], ["a.weight", "m.bias", "b.scale"]]
    for bucket in got:
        for name, tensor in bucket.items():
            assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and tensor.is_contiguous()
            assert torch.equal(tensor, state[name].to(torch.bfloat16))
            assert tensor.data_ptr() != state[name].data_ptr()
    spec = weight_spec(state, torch.float32)
    assert [name for name, _ in spec.tensors] == sorted(state)
    ordered = list(buckets(state, torch.float32, order=spec.tensors, limit=1 << 20))
    assert [list(b) for b in ordered] == [sorted(state)]


def test_a_broadcast_delivers_every_tensor_in_the_specs_order_and_dtype() -> None:
    state = _state()
    spec = weight_spec(state, torch.bfloat16)
    sent: list[torch.Tensor] = []
    sender = RefitGroup.__new__(RefitGroup)  # no process group: record what rank 0 would broadcast
    sender.device = torch.device("cpu")
    sender._broadcast = lambda buffer: sent.append(buffer.clone())  # type: ignore[method-assign]
    sender.send(state, spec)
    assert len(sent) == len(list(bucket_runs(spec.tensors, spec.dtype)))
    flats: Iterator[torch.Tensor] = iter(sent)
    receiver = RefitGroup.__new__(RefitGroup)
    receiver.device = torch.device("cpu")
    receiver._broadcast = lambda buffer: buffer.copy_(next(flats))  # type: ignore[method-assign]
    received = {name: t for bucket in receiver.receive(spec) for name, t in bucket.items()}
    assert list(received) == sorted(state)
    for name, tensor in received.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16))


def test_check_complete_names_what_a_refit_lacks() -> None:
    state = _state()
    spec = weight_spec(state, torch.float32)
    check_complete(spec, state)
    with pytest.raises(KeyError, match=r"missing 1 weight\(s\), e.g. \['m.bias'\]"):
        check_complete(spec, {k: v for k, v in state.items() if k != "m.bias"})
