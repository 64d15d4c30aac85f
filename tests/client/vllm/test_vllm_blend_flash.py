"""CacheBlend's FlashAttention path (client/vllm/blend_flash.py), on CPU.

No GPU runs here: `flash_attn_varlen_func` is emulated with its documented semantics
(paged keys through `block_table`, `seqused_k` keys per sequence, the causal mask
aligned to the end of the keys), and the selected rows' attention through the
pseudo-sequences over a scrambled paged cache must equal the CPU attention over the dense
long K/V (`positions_attention`) for any selection. The pseudo-sequences are one buffer
moved once, built once per selection of rows, and a paged cache not in the queries' dtype
(fp8) is refused.
"""

import sys
import types

import pytest
import torch

from lmcached.client.vllm import blend_flash
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
    seqs = pseudo_sequences(torch.tensor([0, 1, 2, 5, 6, 9]), [7, 3, 5], block_size=BLOCK)
    assert seqs.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert seqs.seqused_k.tolist() == [3, 7, 10]
    assert seqs.block_table.tolist() == [[7, 3, 5]] * 3
    assert seqs.cu_seqlens_q.dtype == seqs.seqused_k.dtype == seqs.block_table.dtype == torch.int32
    assert (seqs.max_seqlen_q, seqs.max_seqlen_k) == (3, 10)
    # every row: one causal prefill
    every = pseudo_sequences(torch.arange(10), [0, 1, 2], block_size=BLOCK)
    assert every.cu_seqlens_q.tolist() == [0, 10] and every.seqused_k.tolist() == [10]
    with pytest.raises(ValueError, match="increasing"):
        pseudo_sequences(torch.tensor([3, 3]), [0])
    with pytest.raises(ValueError, match="no selected rows"):
        pseudo_sequences(torch.tensor([], dtype=torch.int64), [0])
    with pytest.raises(ValueError, match="3 blocks are needed"):
        pseudo_sequences(torch.tensor([0, 8]), [4, 6], block_size=BLOCK)


def test_pseudo_sequences_are_one_buffer_moved_to_the_device_once(monkeypatch):
    to = torch.Tensor.to
    moves = []

    def counting_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out.device != self.device:
            moves.append((self.device.type, out.device.type))
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    seqs = pseudo_sequences(torch.tensor([0, 1, 2, 5, 6, 9]), [7, 3, 5], "meta")
    assert moves == [("cpu", "meta")]
    parts = (seqs.cu_seqlens_q, seqs.seqused_k, seqs.block_table)
    assert all(part.device.type == "meta" and part.dtype == torch.int32 for part in parts)
    assert parts[0]._base is not None and all(part._base is parts[0]._base for part in parts)
    on_cpu = pseudo_sequences(torch.tensor([0, 1, 2, 5, 6, 9]), [7, 3, 5], block_size=BLOCK)
    assert [p.storage_offset() % 64 for p in
            (on_cpu.cu_seqlens_q, on_cpu.seqused_k, on_cpu.block_table)] == [0, 0, 0]
    assert on_cpu.block_table.is_contiguous() and on_cpu.block_table.shape == (3, 3)


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

    seqs = pseudo_sequences(positions, block_ids, block_size=BLOCK)
    got = flash_paged_attention(emulated_varlen, q, key_cache, value_cache, seqs, attn.scaling)
    expected = positions_attention(0, attn, q, k, v, positions)
    assert got.shape == expected.shape == (positions.numel(), HEADS, HEAD)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_on_cpu_the_masked_sdpa_serves():
    assert paged_flash_attention(FakeVllmLlama(), [0, 1]) is None


def cache_of(dtype):
    return torch.empty(2, KV_HEADS, BLOCK, 2 * HEAD, dtype=dtype, device="meta")


def test_flash_applies_only_to_cuda_half_precision_weights():
    meta = {dtype: torch.empty(1, dtype=dtype, device="meta")
            for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    assert not any(flash_applies(p, [cache_of(d)]) for d, p in meta.items())  # not CUDA
    as_cuda = {dtype: types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype)
               for dtype in meta}
    assert flash_applies(as_cuda[torch.float16], [cache_of(torch.float16)])
    assert flash_applies(as_cuda[torch.bfloat16], [cache_of(torch.bfloat16)] * 2)
    assert not flash_applies(as_cuda[torch.float32], [cache_of(torch.float32)])  # no float32


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn, torch.float16,
                                         torch.float32, None])
def test_flash_refuses_a_paged_cache_not_in_the_queries_dtype(cache_dtype, stand_in_vllm):
    """vLLM's fp8 cache is a uint8 (or float8) tensor read right only with descales."""
    bf16 = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    caches = [cache_of(torch.bfloat16), None if cache_dtype is None else cache_of(cache_dtype)]
    assert not flash_applies(bf16, caches)
    assert not flash_applies(bf16, caches[::-1])
    model = flash_model(cache_dtype or torch.float32, torch.zeros(4, dtype=torch.int64))
    assert paged_flash_attention(model, [0, 1]) is None
    same = flash_model(torch.bfloat16, torch.zeros(4, dtype=torch.int64))
    assert paged_flash_attention(same, [0, 1]) is not None  # what refused was the cache


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """vLLM's FlashAttention modules, with `emulated_varlen` as the kernel; yields the
    list of the kernel's calls (their keyword arguments)."""
    calls = []

    def varlen(fa_version, **kwargs):
        calls.append(kwargs)
        return emulated_varlen(**kwargs)

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    fa_utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    fa_utils.is_flash_attn_varlen_func_available = lambda: True
    flash_attn = types.ModuleType("vllm.vllm_flash_attn")
    flash_attn.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, fa_utils.__name__, fa_utils)
    monkeypatch.setitem(sys.modules, flash_attn.__name__, flash_attn)
    yield calls


def flash_model(cache_dtype, kv_positions):
    """A model that looks like a vLLM FlashAttention model on CUDA (the weights say so;
    its tensors are on the CPU), with three layers whose paged caches hold K/V of the
    positions `kv_positions` (int64 `[T]`) in blocks 5, 2, 7, ... Returns the model; its
    `dense` attribute holds each layer's long (K, V), `[T, KV_HEADS, HEAD]`, float32."""
    gen = torch.Generator().manual_seed(3)
    table = [5, 2, 7, 0, 3, 6]
    layers, dense = [], []
    for _ in range(3):
        k = torch.randn(len(kv_positions), KV_HEADS, HEAD, generator=gen)
        v = torch.randn(len(kv_positions), KV_HEADS, HEAD, generator=gen)
        cache = torch.full((8, KV_HEADS, BLOCK, 2 * HEAD), float("nan"))
        for i, pos in enumerate(kv_positions.tolist()):
            cache[table[pos // BLOCK], :, pos % BLOCK] = torch.cat([k[i], v[i]], dim=-1)
        attn = types.SimpleNamespace(kv_cache=cache.to(cache_dtype),
                                     impl=types.SimpleNamespace(vllm_flash_attn_version=3))
        layers.append(types.SimpleNamespace(self_attn=types.SimpleNamespace(attn=attn)))
        dense.append((k, v))
    weight = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    return types.SimpleNamespace(parameters=lambda: iter([weight]), dense=dense,
                                 model=types.SimpleNamespace(layers=layers), table=table)


def test_the_pseudo_sequences_are_built_once_per_selection(monkeypatch, stand_in_vllm):
    builds = []
    build = blend_flash.pseudo_sequences

    def counting_build(positions, *args):
        builds.append(positions.tolist())
        return build(positions, *args)

    monkeypatch.setattr(blend_flash, "pseudo_sequences", counting_build)
    num_tokens = 19
    model = flash_model(torch.bfloat16, torch.arange(num_tokens))
    attention = paged_flash_attention(model, model.table[: -(-num_tokens // BLOCK)])
    assert attention is not None
    attn = types.SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD,
                                 scaling=HEAD ** -0.5)
    gen = torch.Generator().manual_seed(11)
    selected = [0, 1, 2, 7, 8, 15, 18]
    # layer 0 every row, then the same selection at layers 1 and 2 (new tensors each time)
    for layer_id, rows in enumerate([list(range(num_tokens)), selected, selected]):
        positions = torch.tensor(rows)
        q = torch.randn(len(rows), HEADS, HEAD, generator=gen)
        got = attention(layer_id, attn, q.to(torch.bfloat16), None, None, positions)
        k, v = model.dense[layer_id]
        expected = positions_attention(layer_id, attn, q, k, v, positions)
        torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05)
    assert builds == [list(range(num_tokens)), selected]
    calls = [kwargs["cu_seqlens_q"] for kwargs in stand_in_vllm]
    assert len(calls) == 3 and calls[1] is calls[2]
