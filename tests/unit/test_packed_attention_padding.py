"""sdpa_packed pads each sequence to a multiple of SEQUENCE_ROUND (issue 20: a bounded set of attention
shapes, so the CPU kernel caches stop growing) and still computes what unpadded causal attention does."""

import torch
import torch.nn.functional as F

from rlfleet.policy import packed_attention
from rlfleet.policy.packed_attention import SEQUENCE_ROUND, sdpa_packed_attention


def _packed(lengths, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return q, k, v, positions


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_padded_sequences_equal_unpadded_causal_attention_and_gradients():
    lengths = [5, 33, 1, 64, 17]
    q, k, v, positions = _packed(lengths)
    out, _ = sdpa_packed_attention(_Module(), q, k, v, None, position_ids=positions)
    expected, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        kk = k[:, :, sl].repeat_interleave(2, dim=1)
        vv = v[:, :, sl].repeat_interleave(2, dim=1)
        expected.append(F.scaled_dot_product_attention(q[:, :, sl], kk, vv, is_causal=True).transpose(1, 2))
        start += n
    ref = torch.cat(expected, dim=1)
    assert out.shape == ref.shape == (1, sum(lengths), 4, 8)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_every_sequence_reaches_the_kernel_at_a_rounded_length(monkeypatch):
    seen = []
    real = packed_attention.sdpa_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        seen.append(query.shape[2])
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", spy)
    q, k, v, positions = _packed([5, 33, 70])
    sdpa_packed_attention(_Module(), q, k, v, None, position_ids=positions)
    assert seen == [32, 64, 96]
    assert all(n % SEQUENCE_ROUND == 0 for n in seen)


def test_packed_sdpa_mask_builds_nothing_for_one_unpadded_row_only():
    """One row, no padding, queries and keys the same positions: None (the attention masks each packed
    sequence itself); a batch, a padding mask or a decoding step with a cache: transformers' mask."""
    from transformers.masking_utils import causal_mask_function

    from rlfleet.policy.packed_attention import packed_sdpa_mask

    one = {"batch_size": 1, "q_length": 6, "kv_length": 6, "mask_function": causal_mask_function}
    assert packed_sdpa_mask(**one, allow_is_causal_skip=False) is None
    two = packed_sdpa_mask(**{**one, "batch_size": 2}, allow_is_causal_skip=False)
    assert two is not None and two.shape == (2, 1, 6, 6)
    assert torch.equal(two[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    padded = packed_sdpa_mask(**one, attention_mask=padding, allow_is_causal_skip=False)
    assert padded is not None and not padded[0, 0, :, 0].any()
    step = packed_sdpa_mask(**{**one, "q_length": 1, "kv_length": 7}, q_offset=6, allow_is_causal_skip=False)
    assert step is not None and step.shape == (1, 1, 1, 7) and bool(step.all())
