"""Causal attention for queries that do not start at key 0, without a dense mask on CPU.

Why this file exists: a prefill over a cached prefix (queries = the last n of T keys)
and CacheBlend's selected rows (queries at scattered positions, each seeing keys up to
its own position) are causal attentions that PyTorch's `scaled_dot_product_attention`
takes only as an explicit mask, and its CPU kernel with a mask ran 2-2.5x slower than
its causal kernel over the whole square (docs/cacheblend.md). Here the keys are cut
where the mask is all-true, as cascade inference and FlashInfer's merge-state do
(Ye et al., "Cascade Inference", 2024; Dao et al., FlashAttention's log-sum-exp
combination): the queries are taken in groups of consecutive rows, and for a group
whose first position is a and last is b

    keys [0, a)   seen by every row of the group: one unmasked attention
    keys [a, b]   a causal square (contiguous rows: the causal kernel) or a small
                  additive mask (scattered rows)

and the two partial results are merged by their log-sum-exp. The work is the causal
staircase, not the dense rectangle. A contiguous run after a short prefix (under a
quarter of its rows) instead pads its queries to the square and runs the causal kernel
once: the wasted rows cost less than the merge. CPU only (the CPU flash kernel returns the
log-sum-exp); on other devices a contiguous suffix runs SDPA with torch's lower-right
causal bias (flash / memory-efficient kernels on CUDA) and scattered rows SDPA with a
boolean mask.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Rows per group for scattered positions: each group pays a masked square of the keys
# its rows span, so fewer rows per group means less masked work but more kernel calls.
# 64 measured fastest of 32 / 64 / 128 / 256 for CacheBlend's selections at 4k tokens
# on the 2-core CPU VM (benchmarks/bench_attention.py).
SCATTERED_GROUP_ROWS = 64

# A contiguous run whose prefix is shorter than this share of its rows pads its queries
# to the square and runs the causal kernel once (no merge): faster than the split below
# about a fifth of the keys (4k keys, 8 heads of 64, 2-core CPU VM; pad vs split at
# 64 / 256 / 1024 cached: 124 / 123 / 125 ms vs 131 / 127 / 121 ms).
PAD_MAX_PREFIX_SHARE = 0.25

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           positions: torch.Tensor) -> None:
    """Raise ValueError unless the shapes are those `attend_at_positions` documents."""
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"query [B, heads, n, head_size] and key/value [B, kv_heads, T, "
                         f"head_size] expected, got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads")
    if positions.dim() != 1 or positions.numel() != query.shape[2]:
        raise ValueError(f"positions must be int64 [n] with n = {query.shape[2]} query rows, "
                         f"got shape {tuple(positions.shape)}")


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted merge of two partial attentions over disjoint key sets: part a
    weighs exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b), one lerp.

    Args:
        out_a, out_b: `[B, heads, n, head_size]`, any float dtype.
        lse_a, lse_b: float32 `[B, heads, n]`: each part's log-sum-exp of scaled scores.

    Returns:
        `[B, heads, n, head_size]` in out_a's dtype (merged in float32).
    """
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # [B, heads, n, 1] float32
    return torch.lerp(out_b.float(), out_a.float(), weight_a).to(out_a.dtype)


def _group_cpu(query, key, value, group_positions: list[int], scale) -> torch.Tensor:
    """One group of rows on CPU: unmasked keys [0, a) merged with keys [a, b], where a
    and b are the group's first and last positions."""
    first, last = group_positions[0], group_positions[-1]
    if last - first + 1 == len(group_positions):  # contiguous: the causal square
        return _contiguous_cpu(query, key[:, :, :last + 1], value[:, :, :last + 1], first, scale)
    rows = torch.tensor(group_positions)[:, None]  # [g, 1]
    cols = torch.arange(first, last + 1)[None, :]  # [1, b - a + 1]
    mask = torch.zeros(rows.shape[0], cols.shape[1], dtype=query.dtype)
    mask.masked_fill_(cols > rows, float("-inf"))  # key a is visible to every row
    out, lse = _flash_cpu(query, key[:, :, first:last + 1], value[:, :, first:last + 1],
                          attn_mask=mask, scale=scale)
    if first == 0:
        return out
    head_out, head_lse = _flash_cpu(query, key[:, :, :first], value[:, :, :first], scale=scale)
    return _merge(head_out, head_lse, out, lse)


def attend_at_positions(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        positions: torch.Tensor, scale: float | None = None,
                        group_rows: int = SCATTERED_GROUP_ROWS) -> torch.Tensor:
    """Causal attention of queries at given positions over keys at positions 0..T-1.

    Query row i sees keys 0..positions[i] (inclusive), as in a full causal prefill where
    only these rows are computed. Equal, up to rounding, to SDPA with the boolean mask
    `arange(T)[None] <= positions[:, None]`.

    Args:
        query: `[B, num_heads, n, head_size]`, float32 / bfloat16 / float16.
        key, value: `[B, num_kv_heads, T, head_size]`, same dtype and device;
            num_heads a multiple of num_kv_heads (GQA: query head h reads kv head
            h // (num_heads // num_kv_heads), as transformers' `repeat_kv`).
        positions: int64 `[n]`, strictly ascending, each in [0, T), any device.
        scale: softmax scale (None: 1 / sqrt(head_size)).
        group_rows: rows per group where the positions are not one contiguous run
            (groups are also cut at gaps wider than this).

    Returns:
        `[B, num_heads, n, head_size]`, query's dtype and device.

    Raises:
        ValueError: shapes that do not match (the message says which).
    """
    _check(query, key, value, positions)
    num_rows = query.shape[2]
    if num_rows == 0:
        return query.clone()
    first, last = int(positions[0]), int(positions[-1])
    contiguous = last - first + 1 == num_rows
    if query.device.type != "cpu":
        return _attend_generic(query, key, value, positions, scale, contiguous)
    key, value = key[:, :, :last + 1], value[:, :, :last + 1]
    if contiguous:
        return _contiguous_cpu(query, key, value, first, scale)
    cpu_positions = positions.tolist()
    outs = [
        _group_cpu(query[:, :, start:end], key, value, cpu_positions[start:end], scale)
        for start, end in _groups(cpu_positions, group_rows)
    ]
    return torch.cat(outs, dim=2)


def _groups(positions: list[int], group_rows: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) of at most `group_rows` rows, also cut where the next
    position is more than `group_rows` away: a masked square then never spans a gap
    wider than its rows (LegoLink's runs of k rows, one per document, each become a
    contiguous group on the causal kernel)."""
    bounds, start = [], 0
    for row in range(1, len(positions)):
        if row - start == group_rows or positions[row] - positions[row - 1] > group_rows:
            bounds.append((start, row))
            start = row
    bounds.append((start, len(positions)))
    return bounds


def _contiguous_cpu(query, key, value, first: int, scale) -> torch.Tensor:
    """Rows at positions first..T-1 (T = key rows) on CPU: a short prefix pads the
    queries to the causal square; a longer one is attended unmasked and merged with the
    causal square of keys [first, T)."""
    if first == 0:
        return _flash_cpu(query, key, value, is_causal=True, scale=scale)[0]
    if query.shape[2] == 1:  # one row sees every key: no mask, no merge
        return _flash_cpu(query, key, value, scale=scale)[0]
    if first < PAD_MAX_PREFIX_SHARE * query.shape[2]:
        batch, num_heads, _, head_size = query.shape
        padded = torch.cat((query.new_zeros(batch, num_heads, first, head_size), query), dim=2)
        return _flash_cpu(padded, key, value, is_causal=True, scale=scale)[0][:, :, first:]
    out, lse = _flash_cpu(query, key[:, :, first:], value[:, :, first:], is_causal=True,
                          scale=scale)
    head_out, head_lse = _flash_cpu(query, key[:, :, :first], value[:, :, :first], scale=scale)
    return _merge(head_out, head_lse, out, lse)


def _attend_generic(query, key, value, positions, scale, contiguous: bool) -> torch.Tensor:
    """Any device: SDPA with torch's lower-right causal bias for a contiguous suffix of
    the keys (flash / memory-efficient kernels on CUDA), else with a boolean mask."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    num_keys = int(positions[-1]) + 1
    key, value = key[:, :, :num_keys], value[:, :, :num_keys]
    if contiguous:
        bias = causal_lower_right(query.shape[2], num_keys)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    mask = torch.arange(num_keys, device=query.device)[None, :] <= positions.to(query.device)[:, None]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None],
                                          scale=scale)


def attend_causal_suffix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention of the last n of T tokens over all T keys (a prefill after a
    cached prefix of T - n tokens): `attend_at_positions` with positions T-n..T-1.

    Args:
        query: `[B, num_heads, n, head_size]`; key, value: `[B, num_kv_heads, T, head_size]`,
            T >= n (see `attend_at_positions` for dtypes and GQA).
        scale: softmax scale (None: 1 / sqrt(head_size)).

    Returns:
        `[B, num_heads, n, head_size]`, query's dtype and device.

    Raises:
        ValueError: shapes that do not match, or n > T.
    """
    num_rows, num_keys = query.shape[2], key.shape[2]
    if num_rows > num_keys:
        raise ValueError(f"{num_rows} queries cannot be the last tokens of {num_keys} keys")
    positions = torch.arange(num_keys - num_rows, num_keys)
    return attend_at_positions(query, key, value, positions, scale)
