"""CacheBlend's FlashAttention path (client/vllm/blend_flash.py), on CPU.

No GPU runs here: `flash_attn_varlen_func` is emulated with its documented semantics
(paged keys through `block_table`, `seqused_k` keys per sequence, the causal mask
aligned to the end of the keys), and the selected rows' attention through the
pseudo-sequences over a scrambled paged cache must equal the CPU attention over the dense
long K/V (`positions_attention`) for any selection.
"""

import types

import pytest
import torch

from lmcached.client.vllm.blend_flash import (
    flash_applies,
    flash_paged_attention,
    paged_flash_attention,
    pseudo_sequences,
)
from lmcached.client.vllm.blend_layers import positions_attention

from test_vllm_blend_layers import FakeVllmLlama

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 8, 4


def emulated_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                    softmax_scale, causal, block_table):
    """flash_attn_varlen_func over a paged cache `[num_blocks, block_size, H, D]`."""
    assert causal and q.dim() == 3 and k.shape[1] == BLOCK
    outs = []
    for r in range(len(seqused_k)):
        rows = q[int(cu_seqlens_q[r]) : int(cu_seqlens_q[r + 1])]  # [L, heads, D]
        num_rows, num_keys = rows.shape[0], int(seqused_k[r])
        assert num_rows <= max_seqlen_q and num_keys <= max_seqlen_k
        blocks = block_table[r, : -(-num_keys // BLOCK)].long()
        keys = k[blocks].reshape(-1, KV_HEADS, HEAD)[:num_keys]
        values = v[blocks].reshape(-1, KV_HEADS, HEAD)[:num_keys]
        # bottom-right causal: row i of the run sees keys j <= num_keys - num_rows + i
        visible = (torch.arange(num_keys)[None, :]
                   <= (num_keys - num_rows + torch.arange(num_rows))[:, None])
        scores = torch.einsum("qhd,khd->hqk", rows,
                              keys.repeat_interleave(HEADS // KV_HEADS, 1)) * softmax_scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs,
                                 values.repeat_interleave(HEADS // KV_HEADS, 1)))
    return torch.cat(outs)


def test_pseudo_sequences_are_the_runs_of_consecutive_rows():
    seqs = pseudo_sequences(torch.tensor([0, 1, 2, 5, 6, 9]), [7, 3, 5])
    assert seqs.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert seqs.seqused_k.tolist() == [3, 7, 10]
    assert seqs.block_table.tolist() == [[7, 3, 5]] * 3
    assert seqs.cu_seqlens_q.dtype == seqs.seqused_k.dtype == seqs.block_table.dtype == torch.int32
    assert (seqs.max_seqlen_q, seqs.max_seqlen_k) == (3, 10)
    every = pseudo_sequences(torch.arange(10), [0, 1, 2])  # every row: one causal prefill
    assert every.cu_seqlens_q.tolist() == [0, 10] and every.seqused_k.tolist() == [10]
    with pytest.raises(ValueError, match="increasing"):
        pseudo_sequences(torch.tensor([3, 3]), [0])
    with pytest.raises(ValueError, match="no selected rows"):
        pseudo_sequences(torch.tensor([], dtype=torch.int64), [0])


@pytest.mark.parametrize("selection", ["every", "random", "first", "last", "one_per_run"])
def test_flash_over_the_paged_cache_equals_the_masked_sdpa(selection):
    gen = torch.Generator().manual_seed(7)
    num_tokens = 23
    k = torch.randn(num_tokens, KV_HEADS, HEAD, generator=gen)  # the layer's long K/V
    v = torch.randn(num_tokens, KV_HEADS, HEAD, generator=gen)
    num_blocks = -(-num_tokens // BLOCK)
    block_ids = torch.randperm(16, generator=gen)[:num_blocks].tolist()  # a scrambled table
    key_cache = torch.full((16, BLOCK, KV_HEADS, HEAD), float("nan"))
    value_cache = torch.full((16, BLOCK, KV_HEADS, HEAD), float("nan"))
    for pos in range(num_tokens):
        key_cache[block_ids[pos // BLOCK], pos % BLOCK] = k[pos]
        value_cache[block_ids[pos // BLOCK], pos % BLOCK] = v[pos]
    positions = {
        "every": torch.arange(num_tokens),
        "random": torch.nonzero(torch.rand(num_tokens, generator=gen) < 0.4).flatten(),
        "first": torch.tensor([0]),
        "last": torch.tensor([num_tokens - 1]),
        "one_per_run": torch.arange(1, num_tokens, 3),
    }[selection]
    q = torch.randn(positions.numel(), HEADS, HEAD, generator=gen)
    attn = types.SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD,
                                 scaling=HEAD ** -0.5)

    got = flash_paged_attention(emulated_varlen, q, key_cache, value_cache,
                                pseudo_sequences(positions, block_ids), attn.scaling)
    expected = positions_attention(0, attn, q, k, v, positions)
    assert got.shape == expected.shape == (positions.numel(), HEADS, HEAD)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_on_cpu_the_masked_sdpa_serves():
    assert paged_flash_attention(FakeVllmLlama(), [0, 1]) is None


def test_flash_applies_only_to_cuda_half_precision_weights():
    meta = {dtype: torch.empty(1, dtype=dtype, device="meta")
            for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    assert not any(flash_applies(p) for p in meta.values())  # not CUDA
    as_cuda = {dtype: types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype)
               for dtype in meta}
    assert flash_applies(as_cuda[torch.float16]) and flash_applies(as_cuda[torch.bfloat16])
    assert not flash_applies(as_cuda[torch.float32])  # the kernel has no float32
