"""CUDA paths of the client that no other test runs, on a GPU (benchmarks/gpu_window.sh
tests): a store of KV written on the caller's non-default stream, a page-locking that
fails and the process goes on, FlashAttention varlen's call over the paged cache, and
transformers' attention with several queries after a cached prefix. Skipped without CUDA;
their CPU halves are in tests/client/cuda/test_cuda_seams.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcached.client import CacheEngine, KVLayout

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# torch.cuda._sleep cycles that keep a stream busy for ~0.2-0.5 s (1.4-2 GHz clocks):
# long enough that work queued behind it is visibly not done when the host looks.
SLEEP_CYCLES = 700_000_000


def make_layout() -> KVLayout:
    return KVLayout("cuda-paths", num_layers=4, num_kv_heads=4, head_size=64,
                    dtype="bfloat16", chunk_size=64)


def test_kv_written_on_the_callers_side_stream_is_stored_after_it_is_written(daemon):
    layout = make_layout()
    tokens = torch.arange(256)
    expected = torch.randn(layout.chunk_shape(256), device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        with torch.cuda.stream(side):  # the caller's stream, as a serving engine's
            kv = torch.zeros_like(expected)
            torch.cuda._sleep(SLEEP_CYCLES)
            kv.copy_(expected)  # lands only after the sleep, on `side`
            assert engine.store(tokens, kv) == 4
        got, mask = engine.retrieve(tokens, return_tuple=False)
    assert bool(mask.all())
    assert torch.equal(got, expected.cpu()), "the store read the KV before its stream wrote it"


REGISTER_FAILS = textwrap.dedent("""
    import json, resource, sys, types
    import torch
    from lmcached.client.cuda import register_arena, unregister_arena
    from lmcached.shm.arena import HEADER_BYTES, Arena

    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    arena = Arena.create(sys.argv[1], HEADER_BYTES + (64 << 20), prefault=False)
    report = {"registered_under_memlock": register_arena(arena, device=0)}
    if report["registered_under_memlock"]:
        # CAP_IPC_LOCK (root) ignores RLIMIT_MEMLOCK: fail on a range inside the
        # registered one instead (cudaErrorHostMemoryAlreadyRegistered).
        inside = types.SimpleNamespace(base_ptr=arena.base_ptr + (1 << 20),
                                       capacity_bytes=arena.capacity_bytes - (1 << 20))
        report["overlap_registered"] = register_arena(inside, device=0)
        unregister_arena(inside)  # never registered: nothing to undo
    # The process goes on: kernels launch and their errors are their own.
    report["sum"] = float((x * 2).sum().item())
    y = torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    report["finite"] = bool(torch.isfinite(y).all())
    unregister_arena(arena)
    arena.close()
    print(json.dumps(report))
""")


def test_a_failed_page_locking_leaves_no_cuda_error_and_the_process_goes_on(unique_name):
    proc = subprocess.run([sys.executable, "-c", REGISTER_FAILS, unique_name],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.get("overlap_registered", False) is False
    assert (report["sum"], report["finite"]) == (float(1023 * 1024), True)
    assert "cudaHostRegister of the" in proc.stderr  # the one warning, then on
    assert "CUDA error" not in proc.stderr


def varlen_stand_in(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                    softmax_scale, causal, block_table, **kwargs):
    """`vllm.vllm_flash_attn.flash_attn_varlen_func`'s contract over a paged cache, in
    PyTorch (vllm_flash_attn is not on the GPU machine): the argument types the kernel
    requires are asserted, then each run attends through `block_table` with the causal
    mask aligned to the end of its `seqused_k` keys."""
    assert causal and q.is_cuda and q.is_contiguous() and q.dim() == 3
    for t in (cu_seqlens_q, seqused_k, block_table):
        assert t.is_cuda and t.dtype == torch.int32, "int32 device tensors"
    assert k.shape == v.shape and k.dim() == 4 and k.shape[1] % 16 == 0 and k.stride(-1) == 1
    num_heads, num_kv_heads, block_size = q.shape[1], k.shape[2], k.shape[1]
    outs = []
    for r in range(len(seqused_k)):
        rows = q[int(cu_seqlens_q[r]): int(cu_seqlens_q[r + 1])]
        num_rows, num_keys = rows.shape[0], int(seqused_k[r])
        assert num_rows <= max_seqlen_q and num_keys <= max_seqlen_k
        blocks = block_table[r, : -(-num_keys // block_size)].long()
        keys = k[blocks].flatten(0, 1)[:num_keys].repeat_interleave(num_heads // num_kv_heads, 1)
        values = v[blocks].flatten(0, 1)[:num_keys].repeat_interleave(num_heads // num_kv_heads, 1)
        visible = (torch.arange(num_keys, device=q.device)[None, :]
                   <= (num_keys - num_rows + torch.arange(num_rows, device=q.device))[:, None])
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            rows.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=visible, scale=softmax_scale).transpose(0, 1))
    return torch.cat(outs)


def varlen_functions():
    functions = [pytest.param(varlen_stand_in, id="stand-in")]
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        functions.append(pytest.param(None, id="vllm_flash_attn", marks=pytest.mark.skip(
            reason="vllm.vllm_flash_attn is not installed here")))
    else:
        functions.append(pytest.param(flash_attn_varlen_func, id="vllm_flash_attn"))
    return functions


@pytest.mark.parametrize("varlen_fn", varlen_functions())
def test_flash_paged_attention_on_cuda_equals_pytorchs_attention(varlen_fn):
    from lmcached.client.vllm.blend_flash import flash_paged_attention, pseudo_sequences

    heads, kv_heads, head, block, num_tokens = 8, 2, 64, 16, 150
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(num_tokens, kv_heads, head, device="cuda", generator=gen).bfloat16()
    v = torch.randn(num_tokens, kv_heads, head, device="cuda", generator=gen).bfloat16()
    num_blocks = -(-num_tokens // block)
    block_ids = torch.randperm(32, device="cuda", generator=gen)[:num_blocks].tolist()
    key_cache = torch.full((32, block, kv_heads, head), float("nan"), device="cuda").bfloat16()
    value_cache = key_cache.clone()
    for pos in range(num_tokens):
        key_cache[block_ids[pos // block], pos % block] = k[pos]
        value_cache[block_ids[pos // block], pos % block] = v[pos]
    positions = torch.tensor([0, 1, 2, 17, 40, 41, 42, 43, 99, 120, 149])
    q = torch.randn(positions.numel(), heads, head, device="cuda", generator=gen).bfloat16()
    scale = head ** -0.5

    got = flash_paged_attention(varlen_fn, q, key_cache, value_cache,
                                pseudo_sequences(positions, block_ids, device="cuda"), scale)
    # PyTorch's reference: every selected row over the dense K/V up to its own position.
    visible = torch.arange(num_tokens)[None, :] <= positions[:, None]  # [S, num_tokens]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1).float(),
        v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1).float(),
        attn_mask=visible.cuda(), scale=scale).transpose(0, 1)
    assert got.shape == (positions.numel(), heads, head) and got.is_cuda
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_prefix_attention_with_several_queries_on_cuda_equals_sdpa(dtype):
    hf_attention = pytest.importorskip("lmcached.client.hf_attention")

    batch, heads, kv_heads, head, num_queries, num_keys = 2, 8, 2, 64, 7, 300
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, heads, num_queries, head, device="cuda", generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, num_keys, head, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, num_keys, head, device="cuda", generator=gen).to(dtype)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    out, _ = hf_attention.prefix_attention_forward(module, q, k, v, None, scaling=head ** -0.5)
    visible = (torch.arange(num_keys, device="cuda")[None, :]
               <= (num_keys - num_queries + torch.arange(num_queries, device="cuda"))[:, None])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.repeat_interleave(heads // kv_heads, 1).float(),
        v.repeat_interleave(heads // kv_heads, 1).float(), attn_mask=visible,
        scale=head ** -0.5).transpose(1, 2)
    assert out.shape == (batch, num_queries, heads, head) and out.is_cuda and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2 if dtype == torch.bfloat16
                               else 1e-4, rtol=0)
