"""FlashAttention varlen over vLLM's paged cache for CacheBlend's selected rows (CUDA).

Why this file exists: the rows CacheBlend (Yao et al., EuroSys 2025) or LegoLink select
are not a contiguous suffix, which vLLM's attention backends assume
(vllm/v1/attention/backends/flash_attn.py ~l.513 in 0.32.0). On CPU the layer loop
(client/vllm/blend_layers.py) runs `attend_at_positions` over the layer's long K/V. On
CUDA the loop has already written the layer's blended K/V into the request's paged blocks (the
sink, `do_kv_cache_update`), so each maximal run of consecutive selected rows is one
pseudo-sequence of FlashAttention varlen over the paged cache: its queries are the run,
its keys the request's block table with `seqused_k` = the run's last position + 1, and
the kernel's bottom-right causal mask then shows row i exactly the keys at positions <=
its own. No mask is materialized and the K/V are read in place.

    positions:   0 1 2 . . 5 6 . . 9        selected rows (S = 6)
    runs:        [0 1 2]   [5 6]   [9]      cu_seqlens_q = [0, 3, 5, 6]
    seqused_k:    3         7       10      block_table: the request's, repeated 3 times

Selected on CUDA only, where vLLM ships `vllm.vllm_flash_attn`, the layer's backend
is FlashAttention (its kv_cache `[num_blocks, num_kv_heads, block_size, 2 * head_size]`,
flash_attn.py ~l.1252) and the paged cache holds K/V in the queries' dtype (an fp8 cache
needs descales this call does not pass); otherwise `positions_attention` serves. The
pseudo-sequences are built once per selection (`PseudoSequenceCache`: the layers after
the check layer share one), with one host-to-device copy. Not yet run on a GPU: the
pseudo-sequences and the call are checked on CPU against `positions_attention` with an
emulation of the kernel's semantics (tests/client/vllm/test_vllm_blend_flash.py).
vllm-free at import.
"""

import dataclasses
from typing import Callable, Iterable

import torch

from lmcached.client.vllm.blend_layers import AttentionFn
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

_PART_ALIGN = 64  # int32 elements (256 bytes): where each part of the packed buffer starts


@dataclasses.dataclass(frozen=True)
class PseudoSequences:
    """The selected rows of one request as FlashAttention varlen sequences.

    Attributes:
        cu_seqlens_q: int32 `[R + 1]`: where each run starts in the selected rows, then S.
        seqused_k: int32 `[R]`: keys of each run: its last position + 1.
        block_table: int32 `[R, num_blocks]`: the request's vLLM block ids, once per run.
        max_seqlen_q: rows of the longest run.
        max_seqlen_k: the largest `seqused_k`.
    """

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def pseudo_sequences(positions: torch.Tensor, block_ids: list[int],
                     device: torch.device | str = "cpu",
                     block_size: int | None = None) -> PseudoSequences:
    """Cut the selected rows into maximal runs of consecutive positions.

    The three tensors are views of one int32 buffer, copied to `device` at once.

    Args:
        positions: int64 `[S]`, strictly increasing, S >= 1: the selected rows' positions.
        block_ids: the request's vLLM block ids, covering positions `[0, positions[-1]]`.
        device: where the tensors go (the kernel's device).
        block_size: tokens per vLLM block, to check that `block_ids` cover the last
            position (None: not checked).

    Returns:
        PseudoSequences.

    Raises:
        ValueError: no positions, positions not strictly increasing, or block_ids too
            short for the last position (the message says how many blocks are needed).
    """
    positions = positions.to("cpu", torch.int64)
    num_rows = positions.numel()
    if num_rows == 0:
        raise ValueError("no selected rows: a layer without selected rows runs no attention")
    steps = positions.diff()
    if bool((steps <= 0).any()):
        raise ValueError("selected positions must be strictly increasing")
    if block_size is not None and int(positions[-1]) >= len(block_ids) * block_size:
        raise ValueError(f"block_ids cover {len(block_ids) * block_size} positions; the last "
                         f"selected row is at {int(positions[-1])}: "
                         f"{-(-(int(positions[-1]) + 1) // block_size)} blocks are needed")
    ends = torch.cat([torch.nonzero(steps != 1).flatten() + 1,
                      torch.tensor([num_rows])])  # [R]: end of each run in the rows
    num_runs, num_blocks = len(ends), len(block_ids)
    seqused_k = positions[ends - 1] + 1
    # One int32 buffer, one copy to the device: [cu_seqlens_q | seqused_k | block_table],
    # each part starting on a multiple of _PART_ALIGN elements.
    starts = [0]
    for size in (num_runs + 1, num_runs):
        starts.append(starts[-1] + -(-size // _PART_ALIGN) * _PART_ALIGN)
    packed = torch.zeros(starts[-1] + num_runs * num_blocks, dtype=torch.int32)
    packed[1 : num_runs + 1] = ends
    packed[starts[1] : starts[1] + num_runs] = seqused_k
    packed[starts[2]:].view(num_runs, num_blocks)[:] = torch.tensor(block_ids, dtype=torch.int32)
    packed = packed.to(device)
    return PseudoSequences(
        cu_seqlens_q=packed[: num_runs + 1],
        seqused_k=packed[starts[1] : starts[1] + num_runs],
        block_table=packed[starts[2]:].view(num_runs, num_blocks),
        max_seqlen_q=int(ends.diff(prepend=torch.zeros(1, dtype=torch.int64)).max()),
        max_seqlen_k=int(seqused_k.max()),
    )


class PseudoSequenceCache:
    """One request's `pseudo_sequences`, built again only when the selected positions
    change: once the executor has selected its rows (CacheBlend's check layer, LegoLink's
    layer 0), every later layer attends with the same rows, so a request builds them
    about twice (every row, then the selection), not once per layer.

    Args:
        block_ids: the request's vLLM block ids.
        block_size: tokens per vLLM block.
        device: where the tensors go (the kernel's device).
    """

    def __init__(self, block_ids: list[int], block_size: int,
                 device: torch.device | str) -> None:
        self.block_ids = block_ids
        self.block_size = block_size
        self.device = device
        self._positions: torch.Tensor | None = None  # int64 [S], cpu: the key
        self._seqs: PseudoSequences | None = None

    def get(self, positions: torch.Tensor) -> PseudoSequences:
        """The pseudo-sequences of `positions` (int64 `[S]`, any device: one small copy
        to the CPU to compare them with the last ones; the layer loop copies rows
        between host and device at every layer anyway)."""
        key = positions.to("cpu", torch.int64)
        if self._seqs is None or not torch.equal(key, self._positions):
            self._seqs = pseudo_sequences(key, self.block_ids, self.device, self.block_size)
            self._positions = key
        return self._seqs


def flash_paged_attention(varlen_fn: Callable, q: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, seqs: PseudoSequences, scale: float,
                          fa_version: int | None = None) -> torch.Tensor:
    """The selected rows' attention over the paged cache, one pseudo-sequence per run.

    Args:
        varlen_fn: `vllm.vllm_flash_attn.flash_attn_varlen_func` (or a function with its
            keyword arguments and semantics: paged keys through `block_table`, causal
            aligned to the end of `seqused_k`).
        q: `[S, num_heads, head_size]`, model dtype: the selected rows' queries.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_size]` each,
            holding the layer's K/V of every position the runs see.
        seqs: `pseudo_sequences` of the selected rows' positions.
        scale: the softmax scale (the layer's `scaling`).
        fa_version: the FlashAttention version the layer's backend uses, if any.

    Returns:
        `[S, num_heads, head_size]`, q's dtype and device.
    """
    kwargs = {}
    if fa_version is not None:
        kwargs["fa_version"] = fa_version
    return varlen_fn(q=q.contiguous(), k=key_cache, v=value_cache,
                     cu_seqlens_q=seqs.cu_seqlens_q, max_seqlen_q=seqs.max_seqlen_q,
                     seqused_k=seqs.seqused_k, max_seqlen_k=seqs.max_seqlen_k,
                     softmax_scale=scale, causal=True, block_table=seqs.block_table,
                     **kwargs)


def flash_applies(parameter: torch.Tensor, kv_caches: Iterable[torch.Tensor | None]) -> bool:
    """Whether FlashAttention over the paged cache can serve a model whose weights are like
    `parameter` (its queries' device and dtype) and whose layers' paged caches are
    `kv_caches`: on CUDA, queries in float16 or bfloat16 (the kernel's only dtypes; a
    float32 model keeps `positions_attention`), and every cache in the queries' dtype. A
    quantized cache (vLLM's fp8 `kv_cache_dtype`: a uint8 or float8 tensor) is read right
    only with the layer's descales, which this call does not pass: refused, so that
    `positions_attention` serves (it reads the layer's K/V in the model's dtype). A
    missing cache (None) is refused too."""
    if parameter.device.type != "cuda" or parameter.dtype not in (torch.float16,
                                                                   torch.bfloat16):
        return False
    return all(cache is not None and cache.dtype == parameter.dtype for cache in kv_caches)


def paged_flash_attention(model, block_ids: list[int]) -> AttentionFn | None:
    """The `AttentionFn` of one request over vLLM's paged cache, or None where it does
    not apply (not `flash_applies`, no `vllm.vllm_flash_attn`, a backend other than
    FlashAttention): the caller then uses `positions_attention`. Its pseudo-sequences
    are built once per selection of rows (`PseudoSequenceCache`), not once per layer.

    The layer's blended K/V must be in the paged cache before the call (the layer loop
    calls its sink first); positions below the claim are vLLM's own prefix-cache hit,
    already there.

    Args:
        model: the blend-aware vLLM model (its layers' `self_attn.attn`).
        block_ids: the request's vLLM block ids.
    """
    layers = model.model.layers
    if not flash_applies(next(model.parameters()),
                         (getattr(layer.self_attn.attn, "kv_cache", None) for layer in layers)):
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
        if not is_flash_attn_varlen_func_available():
            return None
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    first = layers[0].self_attn.attn
    if not hasattr(first.impl, "vllm_flash_attn_version"):
        return None  # FlashInfer, Triton, ...: their caches have other layouts
    # kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    seqs = PseudoSequenceCache(block_ids, first.kv_cache.shape[2], first.kv_cache.device)

    def attention(layer_id: int, attn, q, k, v, positions) -> torch.Tensor:
        layer = layers[layer_id].self_attn.attn
        # [num_blocks, num_kv_heads, block_size, 2 * D] -> K, V [num_blocks, block_size, H, D]
        key_cache, value_cache = layer.kv_cache.transpose(1, 2).split(attn.head_dim, dim=-1)
        return flash_paged_attention(flash_attn_varlen_func, q, key_cache, value_cache,
                                     seqs.get(positions), attn.scaling,
                                     layer.impl.vllm_flash_attn_version)

    logger.info("lmcached blend: selected rows attend through FlashAttention varlen over "
                "the paged cache")
    return attention
