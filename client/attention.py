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
staircase, not the dense rectangle. Scattered rows run every group's masked square in
one batched call (squares padded to the largest, `PositionsPlan`), one unmasked call per
group for its keys [0, a) and one merge for all rows: kernel calls cost about 0.4 ms
each on the 2-core VM even when quiet, and far more when its cores are shared (each
call waits for both threads), so they are kept few. A contiguous run after a short
prefix (under a quarter of its rows) instead pads its queries to the square and runs
the causal kernel once: the wasted rows cost less than the merge. CPU only (the CPU
flash kernel returns the log-sum-exp); on other devices a contiguous suffix runs SDPA
with torch's lower-right causal bias (flash / memory-efficient kernels on CUDA) and
scattered rows SDPA with a boolean mask.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Rows per group for scattered positions: each group pays a masked square of the keys
# its rows span, so fewer rows per group means less masked work but more kernel calls.
# 64 measured fastest of 32 / 64 / 128 / 256 for CacheBlend's selections at 4k tokens
# on the 2-core CPU VM (benchmarks/blend/bench_attention.py).
SCATTERED_GROUP_ROWS = 64

# A group of scattered rows ends before its keys span more than this many per row of
# group_rows (1024 keys for 64 rows; CacheBlend's 15% spans about 430): every group's
# square is padded to the widest one, so one sparse stretch must not widen them all.
SQUARE_KEYS_PER_ROW = 16

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


class PositionsPlan:
    """How `attend_at_positions` cuts the query rows at `positions` on CPU: computed once
    per selection, reusable by every layer that attends from the same rows (blend_prefill's
    layers after the selection).

    Scattered rows are cut into groups (`_groups`); group g, rows at positions
    a_g..b_g, pads its rows to R (the largest group) and its keys [a_g, a_g + W) to W
    (the widest span), so that every group's masked square runs as one batched call:

        queries  [G, heads, R, head_size]     slot (g, r): row start_g + r (a padded
                                              slot repeats the group's last row)
        keys     [G, kv_heads, W, head_size]  key a_g + c (clamped to the last key;
                                              a padded column is masked)
        mask     [G, 1, R, W]                 key a_g + c visible iff <= the slot's position

    Attributes:
        positions: int64 `[n]`, cpu: the rows' positions, strictly ascending.
        num_keys: positions[-1] + 1: the keys the rows read.
        contiguous: the rows are one run (the causal kernel; nothing below is set).
        num_groups, rows, width: G, R and W above.
        query_index: int64 `[G * R]`: the query row of each padded slot.
        key_index: int64 `[G * W]`: the key of each padded square column.
        slot_group, slot_row: int64 `[n]`: each row's slot (g, r).
        prefix_groups: (row start, row end, a_g) of the groups with a_g > 0, whose rows
            also see the keys [0, a_g) unmasked: a suffix of the rows.
    """

    def __init__(self, positions: torch.Tensor, group_rows: int = SCATTERED_GROUP_ROWS):
        """Args:
            positions: int64 `[n]`, n >= 1, strictly ascending, any device.
            group_rows: rows per group (groups are also cut at gaps wider than this,
                and before their keys span more than SQUARE_KEYS_PER_ROW x group_rows).
        """
        self.positions = positions.to("cpu", torch.int64)
        self.group_rows = group_rows
        cpu_positions = self.positions.tolist()
        first, last = cpu_positions[0], cpu_positions[-1]
        self.num_keys = last + 1
        self.contiguous = last - first + 1 == len(cpu_positions)
        self._masks: dict[torch.dtype, torch.Tensor] = {}
        if self.contiguous:
            return
        bounds = _groups(cpu_positions, group_rows)
        firsts = [cpu_positions[start] for start, _ in bounds]
        self.num_groups = len(bounds)
        self.rows = rows = max(end - start for start, end in bounds)
        self.width = width = max(cpu_positions[end - 1] - cpu_positions[start] + 1
                                 for start, end in bounds)
        self.query_index = torch.tensor([min(start + r, end - 1) for start, end in bounds
                                         for r in range(rows)])  # [G * R]
        self.slot_group = torch.tensor([g for g, (start, end) in enumerate(bounds)
                                        for _ in range(end - start)])  # [n]
        self.slot_row = torch.tensor([r for start, end in bounds
                                      for r in range(end - start)])  # [n]
        key_positions = torch.tensor(firsts)[:, None] + torch.arange(width)[None, :]  # [G, W]
        self.key_index = key_positions.clamp(max=last).reshape(-1)  # [G * W]
        slot_positions = self.positions[self.query_index].view(len(bounds), rows)  # [G, R]
        # bool [G, 1, R, W]: key a_g + c is visible from slot (g, r).
        self._visible = (key_positions[:, None, :] <= slot_positions[:, :, None])[:, None]
        self.prefix_groups = [(start, end, a) for (start, end), a in zip(bounds, firsts) if a]

    def matches(self, positions: torch.Tensor) -> bool:
        """True if this plan was made for `positions` (compared by value)."""
        return (positions.numel() == self.positions.numel()
                and torch.equal(positions.to("cpu", torch.int64), self.positions))

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The squares' additive mask `[G, 1, R, W]` in `dtype` (0 or -inf), made once."""
        mask = self._masks.get(dtype)
        if mask is None:
            mask = torch.zeros(self._visible.shape, dtype=dtype)
            mask.masked_fill_(~self._visible, float("-inf"))
            self._masks[dtype] = mask
        return mask


def _scattered_cpu(query, key, value, plan: PositionsPlan, scale) -> torch.Tensor:
    """Scattered rows on CPU (see `PositionsPlan`): every group's masked square in one
    call, plus one unmasked call per group over its keys [0, a_g), merged by log-sum-exp.
    Returns `[B, heads, n, head_size]` (a view, token-major memory)."""
    batch, num_heads, _, head_size = query.shape
    num_groups, rows, width = plan.num_groups, plan.rows, plan.width

    def by_group(x, index, size):  # [B, h, G * size, D] -> [B * G, h, size, D]
        x = x.index_select(2, index).view(batch, x.shape[1], num_groups, size, head_size)
        return x.transpose(1, 2).reshape(batch * num_groups, x.shape[1], size, head_size)

    mask = plan.mask(query.dtype)
    out, lse = _flash_cpu(by_group(query, plan.query_index, rows),
                          by_group(key, plan.key_index, width),
                          by_group(value, plan.key_index, width),
                          attn_mask=mask if batch == 1 else mask.repeat(batch, 1, 1, 1),
                          scale=scale)  # [B * G, heads, R, D], float32 [B * G, heads, R]
    out = out.view(batch, num_groups, num_heads, rows, head_size)
    lse = lse.view(batch, num_groups, num_heads, rows)
    # Each row's slot: [n, B, heads, D] -> [B, heads, n, D]; [n, B, heads] -> [B, heads, n].
    out = out[:, plan.slot_group, :, plan.slot_row].permute(1, 2, 0, 3)
    lse = lse[:, plan.slot_group, :, plan.slot_row].permute(1, 2, 0)
    if not plan.prefix_groups:
        return out
    heads = [_flash_cpu(query[:, :, start:end], key[:, :, :a], value[:, :, :a], scale=scale)
             for start, end, a in plan.prefix_groups]
    first_row = plan.prefix_groups[0][0]
    head_out = torch.cat([part[0] for part in heads], dim=2)  # [B, heads, n - first_row, D]
    head_lse = torch.cat([part[1] for part in heads], dim=2)  # float32 [B, heads, n - first_row]
    merged = _merge(head_out, head_lse, out[:, :, first_row:], lse[:, :, first_row:])
    if first_row == 0:
        return merged
    out = out.clone()
    out[:, :, first_row:] = merged
    return out


def attend_at_positions(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        positions: torch.Tensor, scale: float | None = None,
                        group_rows: int = SCATTERED_GROUP_ROWS,
                        plan: PositionsPlan | None = None) -> torch.Tensor:
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
        plan: `PositionsPlan(positions, group_rows)` made beforehand, to reuse it over
            layers (CPU); None: made here.

    Returns:
        `[B, num_heads, n, head_size]`, query's dtype and device (not necessarily
        contiguous).

    Raises:
        ValueError: shapes that do not match, or a plan made for other positions (the
            message says which).
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
    if plan is None:
        plan = PositionsPlan(positions, group_rows)
    elif not plan.matches(positions):
        raise ValueError("plan was made for other positions: make one PositionsPlan per "
                         "selection (PositionsPlan(positions))")
    return _scattered_cpu(query, key, value, plan, scale)


def _groups(positions: list[int], group_rows: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) of at most `group_rows` rows, also cut where the next
    position is more than `group_rows` away (a masked square never spans a gap wider
    than its rows: LegoLink's runs of k rows, one per document, each become a group),
    and before a group's keys span more than SQUARE_KEYS_PER_ROW x group_rows (every
    square is padded to the widest)."""
    max_span = SQUARE_KEYS_PER_ROW * group_rows
    bounds, start = [], 0
    for row in range(1, len(positions)):
        if (row - start == group_rows or positions[row] - positions[row - 1] > group_rows
                or positions[row] - positions[start] >= max_span):
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
