"""attend_at_positions / attend_causal_suffix against SDPA with the explicit mask."""

import pytest
import torch
import torch.nn.functional as F

from lmcached.client import attention
from lmcached.client.attention import attend_at_positions, attend_causal_suffix

CHUNK = 16
NUM_KEYS = 80
# fp32: the merge by log-sum-exp is exact up to rounding (seen: < 1e-6).
# bf16: inputs and outputs rounded to 8 mantissa bits; both paths accumulate in fp32,
# the reference rounds its probabilities to bf16 before the product with V.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(query, key, value, positions):
    """SDPA over repeat_kv'd K/V with the boolean mask key j <= positions[i]."""
    groups = query.shape[1] // key.shape[1]
    mask = torch.arange(key.shape[2])[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(groups, 1),
        value.float().repeat_interleave(groups, 1), attn_mask=mask[None, None])


def qkv(num_rows, dtype, num_heads=4, num_kv_heads=2, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_heads, num_rows, 16, generator=gen).to(dtype)
    k = torch.randn(batch, num_kv_heads, NUM_KEYS, 16, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, NUM_KEYS, 16, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_cached", [0, 1, CHUNK - 1, NUM_KEYS // 2, NUM_KEYS - 1])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_suffix_equals_masked_sdpa(num_cached, dtype, num_heads, num_kv_heads):
    q, k, v = qkv(NUM_KEYS - num_cached, dtype, num_heads, num_kv_heads, batch=2)
    out = attend_causal_suffix(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k, v, torch.arange(num_cached, NUM_KEYS))
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_rows", [1, 3, 64])
def test_scattered_positions_equal_masked_sdpa(dtype, group_rows):
    gen = torch.Generator().manual_seed(3)
    # CacheBlend-like: a random 20% of the tokens, a run at the start, the last tokens.
    scattered = torch.randperm(NUM_KEYS - 8, generator=gen)[:16] + 4
    positions = torch.cat((torch.arange(4), scattered, torch.arange(NUM_KEYS - 4, NUM_KEYS)))
    positions = positions.unique()  # sorted, distinct
    q, k, v = qkv(positions.numel(), dtype, batch=2)
    out = attend_at_positions(q, k, v, positions, scale=0.3, group_rows=group_rows)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        attn_mask=(torch.arange(NUM_KEYS)[None] <= positions[:, None])[None, None], scale=0.3)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("contiguous", [True, False])
def test_other_devices_path_equals_masked_sdpa(contiguous):
    """The non-CPU branch (lower-right causal bias / boolean mask), run here on CPU."""
    positions = torch.arange(30, NUM_KEYS) if contiguous else torch.tensor([0, 5, 6, 40, 79])
    q, k, v = qkv(positions.numel(), torch.float32)
    out = attention._attend_generic(q, k, v, positions, None, contiguous)
    torch.testing.assert_close(out, reference(q, k, v, positions), atol=1e-5, rtol=0)


def test_keys_past_the_last_query_are_not_read():
    positions = torch.tensor([2, 3, 9])
    q, k, v = qkv(3, torch.float32)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, 10:], poisoned_v[:, :, 10:] = float("nan"), float("nan")
    out = attend_at_positions(q, poisoned_k, poisoned_v, positions)
    torch.testing.assert_close(out, reference(q, k, v, positions), atol=1e-5, rtol=0)


def test_refuses_shapes_that_do_not_match():
    q, k, v = qkv(5, torch.float32)
    with pytest.raises(ValueError, match="positions must be int64"):
        attend_at_positions(q, k, v, torch.arange(4))
    with pytest.raises(ValueError, match="not a multiple"):
        attend_at_positions(torch.randn(1, 3, 5, 16), k, v, torch.arange(5))
    with pytest.raises(ValueError, match="cannot be the last tokens"):
        attend_causal_suffix(torch.randn(1, 4, NUM_KEYS + 1, 16), k, v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_masked_sdpa(dtype):
    for positions in (torch.arange(CHUNK - 1, NUM_KEYS), torch.tensor([0, 5, 6, 40, 79])):
        q, k, v = qkv(positions.numel(), dtype)
        out = attend_at_positions(q.cuda(), k.cuda(), v.cuda(), positions)
        assert out.is_cuda and out.dtype == dtype
        torch.testing.assert_close(out.float().cpu(), reference(q, k, v, positions),
                                   atol=ATOL[dtype], rtol=0)


def test_groups_squares_run_as_one_call_and_their_prefixes_unmasked(monkeypatch):
    """LegoLink's selection: a run of rows per document, documents far apart. Every
    group's square runs in one batched masked call; each group after key 0 adds one
    unmasked call over the keys before it: 1 + 3 calls, not 2 per group plus merges."""
    masks = []
    real = attention._flash_cpu

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_flash_cpu", spy)
    positions = torch.cat((torch.arange(20, 24), torch.arange(60, 64), torch.tensor([79])))
    q, k, v = qkv(positions.numel(), torch.float32)
    out = attend_at_positions(q, k, v, positions, group_rows=8)
    torch.testing.assert_close(out, reference(q, k, v, positions), atol=1e-5, rtol=0)
    assert len(masks) == 4 and masks[0].shape == (3, 1, 4, 4)  # G=3 squares of 4 x 4
    assert all(mask is None for mask in masks[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plan_serves_every_layer_and_refuses_other_positions(dtype):
    positions = torch.tensor([0, 3, 4, 9, 30, 31, 50, 79])
    plan = attention.PositionsPlan(positions, group_rows=3)
    for seed in (0, 1):  # two "layers", one plan
        q, k, v = qkv(positions.numel(), dtype, seed=seed)
        out = attend_at_positions(q, k, v, positions, plan=plan)
        torch.testing.assert_close(out.float(), reference(q, k, v, positions),
                                   atol=ATOL[dtype], rtol=0)
    with pytest.raises(ValueError, match="plan was made for other positions"):
        attend_at_positions(q, k, v, positions + 1, plan=plan)


def test_a_sparse_stretch_does_not_widen_every_square():
    """Rows 20 keys apart with groups of 32 rows would span 620 keys: the group ends
    before 16 x 32 = 512 keys, so every padded square is at most 512 wide."""
    num_keys = 1200
    positions = torch.arange(0, num_keys, 20)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, positions.numel(), 16, generator=gen)
    k, v = torch.randn(2, 1, 2, num_keys, 16, generator=gen)
    plan = attention.PositionsPlan(positions, group_rows=32)
    assert plan.width <= 16 * 32 and plan.num_groups == 3
    out = attend_at_positions(q, k, v, positions, plan=plan)
    torch.testing.assert_close(out, reference(q, k, v, positions), atol=1e-5, rtol=0)


def test_one_row_takes_one_unmasked_call(monkeypatch):
    """The last token alone (blend_prefill's last layer): every key up to it, one call."""
    calls = []
    real = attention._flash_cpu

    def spy(query, key, value, **kwargs):
        calls.append((key.shape[2], kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(attention, "_flash_cpu", spy)
    for position in (NUM_KEYS - 1, 40):
        calls.clear()
        q, k, v = qkv(1, torch.float32, seed=position)
        out = attend_at_positions(q, k, v, torch.tensor([position]))
        torch.testing.assert_close(out, reference(q, k, v, torch.tensor([position])),
                                   atol=1e-5, rtol=0)
        assert calls == [(position + 1, None, False)]
