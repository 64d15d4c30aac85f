"""Blend executors: which tokens a layer recomputes, and the K/V their attention reads.

Why this file exists: blending reuses the cached KV of every retrieved document, not only
the prefix, and recomputes a few tokens so that documents see each other again. Two
strategies share one bookkeeping (argument checks, per-request counts, re-rotation of
the reused K, scattering fresh rows into the long K/V):

    CacheBlendImpl   CacheBlend (Yao et al., EuroSys 2025; LMCache's `lmcache.blend`):
                     full layers up to a check layer; there the reused tokens whose
                     fresh K deviates most are selected; later layers compute only them.
    LegoLinkImpl     EPIC's LegoLink (Hu et al., ICML 2025): from layer 0 on, only the
                     first k tokens of each reused document (its attention sink) and the
                     tokens without reused KV are computed.

Per layer, for a batch of N tokens laid out by `query_start_loc` (S = selected rows):

    layer      fresh q/k/v rows   returned q   returned k/v (N rows)
    < check    N                  N            fresh
    = check    N                  S            fresh                      (CacheBlend)
    > check    S                  S            reused, fresh rows at S
    0          N                  S            reused, fresh rows at S    (LegoLink)
    > 0        S                  S            reused, fresh rows at S    (LegoLink)

"reused" K is the retrieved K rotated from `original_positions` to each token's index in
its request, by one rotation of the position delta (see rope.py).
"""

import math
from typing import Callable

import torch

from lmcached.client.blend.interfaces import BlendExecutor, BlendOutput, PositionalEncoder
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """int64 indices of the nonzero entries of a 1-D `mask` (LMCache's helper)."""
    return mask.nonzero(as_tuple=True)[0]


def indices_to_mask(indices: torch.Tensor, size: int) -> torch.Tensor:
    """int64 `[size]` CPU mask, 1 at `indices` and 0 elsewhere (LMCache's helper)."""
    mask = torch.zeros(size, dtype=torch.long)
    mask[indices] = 1
    return mask


def create_index(ndims: int, target_dim: int, index) -> tuple:
    """An index selecting `index` along `target_dim` of an `ndims`-D tensor, all of every
    other axis: `t[create_index(t.dim(), token_dim, rows)]` (LMCache's helper)."""
    index_obj = [slice(None)] * ndims
    index_obj[target_dim] = index
    return tuple(index_obj)


def _positions_in_request(query_start_loc: torch.Tensor) -> torch.Tensor:
    """int64 [N]: each token's index in its request (an arange restarted at each start)."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    starts = torch.repeat_interleave(query_start_loc[:-1], counts)
    return torch.arange(int(query_start_loc[-1])) - starts


class _SelectiveBlend(BlendExecutor):
    """What both strategies share: argument checks, per-layer state, the reused K (one
    rotation per layer), and the long K/V with fresh rows at the selected tokens.

    State lives between the layers of one batch and is reset at layer 0, so one instance
    serves request after request (LMCache's newest executor kept it across requests,
    LMCache issue #2496). Layers must come in order 0, 1, 2, ...
    """

    def __init__(self, delta_rotation: bool):
        self.delta_rotation = bool(delta_rotation)
        self._encoder: PositionalEncoder | None = None
        self._reverse_encoder: PositionalEncoder | None = None
        self._warned_unrotated = False
        self._selected: torch.Tensor | None = None  # int64 [num_selected], cpu, ascending
        self._moves: tuple[torch.Tensor, ...] | None = None  # _reused_k's positions, per batch
        self._num_tokens = 0
        self._next_layer = 0

    def set_positional_encoder(self, fn: PositionalEncoder) -> None:
        """Set the encoder `(positions, q, k) -> (q, k)` that rotates the reused K.

        It is called with token-first tensors (`k` as `[num_tokens, ..., head_size]`,
        the token axis moved first, as vLLM's rotary embedding takes them), `q` None,
        and int64 `positions` on K's device: the delta (new - original) when
        `delta_rotation`, else the new positions after the reverse encoder ran.
        `LlamaRotary.encoder` fits.

        Raises:
            TypeError: fn is not callable.
        """
        if not callable(fn):
            raise TypeError("positional encoder must be callable (positions, q, k) -> (q, k), "
                            f"got {fn!r}")
        self._encoder = fn

    def set_reverse_positional_encoder(self, fn: PositionalEncoder) -> None:
        """Set the encoder that removes RoPE at `positions`; used only when
        `delta_rotation=False` (LMCache's two passes). Same calling convention.

        Raises:
            TypeError: fn is not callable.
        """
        if not callable(fn):
            raise TypeError(f"reverse positional encoder must be callable, got {fn!r}")
        self._reverse_encoder = fn

    def _start_layer(self, layer_id, retrieved_k, retrieved_v, valid_mask, original_positions,
                     fresh_q, fresh_k, fresh_v, positions, query_start_loc, token_dim):
        """Check one layer's arguments; reset at layer 0. Returns (valid bool [N] cpu,
        original int64 [N] cpu, query_start_loc int64 [B+1] cpu, token_dim >= 0)."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"layer_id must be an int >= 0, got {layer_id!r}")
        if layer_id == 0:
            self._selected, self._num_tokens, self._moves = None, 0, None
        elif layer_id != self._next_layer:
            raise ValueError(f"blend() got layer {layer_id}, expected {self._next_layer}: call "
                             "it for layers 0, 1, 2, ... in order (layer 0 starts a batch)")
        if fresh_q is None and not self.selects_from_fresh_k(layer_id):
            raise ValueError(f"fresh_q is None at layer {layer_id}: only a layer where "
                             "selects_from_fresh_k() is True (CacheBlend's check layer) takes None")
        if not -fresh_k.dim() <= token_dim < fresh_k.dim():
            raise ValueError(f"token_dim {token_dim} is not an axis of K "
                             f"(shape {tuple(fresh_k.shape)})")
        token_dim %= fresh_k.dim()
        if valid_mask.dim() != 1 or valid_mask.is_floating_point() or not valid_mask.is_cpu:
            raise ValueError("valid_mask must be a 1-D bool (or 0/1 integer) CPU tensor "
                             f"[num_tokens], got {valid_mask.dtype} {tuple(valid_mask.shape)} "
                             f"on {valid_mask.device}")
        valid = valid_mask.to(torch.bool)
        num_tokens = valid.numel()
        if original_positions.shape != (num_tokens,):
            raise ValueError(f"original_positions must be [{num_tokens}] like valid_mask, got "
                             f"{tuple(original_positions.shape)}")
        original = original_positions.to("cpu", torch.int64)
        qsl = query_start_loc.to("cpu", torch.int64)
        if (qsl.dim() != 1 or qsl.numel() < 2 or qsl[0] != 0 or qsl[-1] != num_tokens
                or (qsl[1:] < qsl[:-1]).any()):
            raise ValueError(f"query_start_loc must be the batch's original request starts, "
                             f"[batch + 1] ascending from 0 to {num_tokens}; got {qsl.tolist()}")
        if (retrieved_k is None) != (retrieved_v is None):
            raise ValueError("retrieved_k and retrieved_v must both be tensors or both None")
        if retrieved_k is None and valid.any():
            raise ValueError("valid_mask marks retrieved tokens but retrieved_k is None")
        if retrieved_k is not None:
            for name, got, fresh in (("k", retrieved_k, fresh_k), ("v", retrieved_v, fresh_v)):
                want = list(fresh.shape)
                want[token_dim] = num_tokens
                if (list(got.shape) != want or got.dtype != fresh.dtype
                        or got.device != fresh.device):
                    raise ValueError(
                        f"retrieved_{name} must cover every token like fresh_{name}: shape "
                        f"{tuple(want)}, {fresh.dtype} on {fresh.device}; got {tuple(got.shape)}, "
                        f"{got.dtype} on {got.device}")
        self._next_layer = layer_id + 1
        return valid, original, qsl, token_dim

    @staticmethod
    def _check_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, num_rows, which):
        """Raise ValueError unless fresh q/k/v and positions all have `num_rows` tokens."""
        got = {"fresh_k": fresh_k.shape[token_dim], "fresh_v": fresh_v.shape[token_dim],
               "positions": positions.numel()}
        if fresh_q is not None:  # None: Q of the selection computed after blend()
            got["fresh_q"] = fresh_q.shape[token_dim]
        if any(n != num_rows for n in got.values()) or fresh_k.shape != fresh_v.shape:
            raise ValueError(f"this layer needs fresh Q/K/V and positions of {which} "
                             f"({num_rows} rows along token_dim {token_dim}); got {got}")

    def _check_selected_rows(self, fresh_q, fresh_k, fresh_v, positions, token_dim, num_tokens):
        """After the selection: fresh rows must be exactly the selected tokens."""
        if self._selected is None or self._num_tokens != num_tokens:
            raise ValueError("no selection for this batch: run blend() from layer 0 on the same "
                             f"{num_tokens} tokens first")
        self._check_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, self._selected.numel(),
                         "the selected tokens only (BlendOutput.local_indices)")

    def _reused_k(self, retrieved_k, valid, original, qsl, token_dim):
        """The retrieved K with every row rotated to its index in its request.

        One encoder call on a copy of every row, token axis first (delta = new -
        original), or, with `delta_rotation=False`, the reverse encoder at the original
        positions then the encoder at the new ones; rows without retrieved KV (undefined,
        replaced by fresh rows later) are moved by 0. The positions are made once per
        batch, the same tensors every layer (an encoder may cache what it derives from
        them). Without the needed encoder(s), K as stored (one warning). Never writes into
        retrieved_k (in-place encoders such as vLLM's get the copy); may return it
        unchanged.
        """
        if not valid.any():
            return retrieved_k
        if self._encoder is None or (not self.delta_rotation and self._reverse_encoder is None):
            if not self._warned_unrotated:
                logger.warning("blend: no positional encoder set (%s needed); reusing K at the "
                               "positions it was computed at, which is wrong for RoPE models",
                               "set_positional_encoder" if self.delta_rotation
                               else "set_positional_encoder and set_reverse_positional_encoder")
                self._warned_unrotated = True
            return retrieved_k
        device = retrieved_k.device
        if self._moves is None:  # int64 [N] each, on K's device, once per batch
            new = _positions_in_request(qsl)
            old = torch.where(valid, original, new)
            self._moves = (((new - old).to(device),) if self.delta_rotation
                           else (old.to(device), new.to(device)))
        k = retrieved_k.movedim(token_dim, 0).clone()  # [N, ...], token axis first
        if self.delta_rotation:
            _, k = self._encoder(self._moves[0], None, k)
        else:
            _, k = self._reverse_encoder(self._moves[0], None, k)
            _, k = self._encoder(self._moves[1], None, k)
        return k.movedim(0, token_dim)

    def _record_selection(self, mask, qsl):
        """Record `mask` (bool [N], cpu) as the selection. Returns (local_indices int64
        cpu, new query_start_loc int64 [B+1] cpu)."""
        selected = mask_to_indices(mask)
        self._selected, self._num_tokens = selected, mask.numel()
        counts = torch.cat((torch.zeros(1, dtype=torch.int64), mask.to(torch.int64).cumsum(0)))
        return selected, counts[qsl]

    def _select(self, mask, fresh_q, positions, qsl, token_dim):
        """Record `mask` as the selection (`_record_selection`). Returns (q of the selected
        rows, their positions, local_indices, new query_start_loc)."""
        selected, new_qsl = self._record_selection(mask, qsl)
        q = fresh_q.index_select(token_dim, selected.to(fresh_q.device))
        return q, positions[selected.to(positions.device)], selected, new_qsl

    def _long_kv(self, retrieved_k, retrieved_v, valid, original, qsl, fresh_k, fresh_v,
                 token_dim):
        """Long K/V (N rows): reused K / retrieved V, fresh rows at the selection."""
        if retrieved_k is None:  # nothing retrieved: every token is selected and fresh
            return fresh_k, fresh_v
        rows = self._selected.to(fresh_k.device)
        k = self._reused_k(retrieved_k, valid, original, qsl, token_dim)
        k = k.clone() if k is retrieved_k else k
        v = retrieved_v.clone()
        k.index_copy_(token_dim, rows, fresh_k)
        v.index_copy_(token_dim, rows, fresh_v)
        return k, v


class CacheBlendImpl(_SelectiveBlend):
    """CacheBlend's selective recompute (Yao et al., EuroSys 2025), LMCache's semantics.

    Layers before `check_layer` compute every token. At `check_layer` the caller passes
    fresh Q/K/V of every token; per request, the reused tokens whose fresh K deviates
    most from their reused K are selected, plus every token without reused KV; Q of the
    selected rows comes back with the fresh K/V of every token (at this layer the
    selected queries attend to fresh K/V). Later layers get fresh Q/K/V of the selected
    rows only and return the reused K/V with those rows scattered in.

    Deliberate deviations from LMCache's `CacheBlendImpl`:
        (a) the deviation is on K, not V: mean squared difference over every non-token
            axis between the fresh K and the re-rotated reused K (as the issue and
            LMCache's newer `LMCBlender` do);
        (b) per request exactly ceil(recompute_ratio * reused tokens) reused tokens are
            selected (LMCache floors, and lets tokens without reused KV take top-k slots
            by ties; here they score -inf); the product is rounded to 9 decimals before
            the ceiling, so 0.28 * 25 (7.000000000000001 in floats) selects 7, not 8;
        (c) state resets at layer 0, so one instance serves request after request;
        (d) reused K is moved by one rotation of the delta new - original (rotations
            compose), on the valid rows only, once per layer from the check layer on;
            `delta_rotation=False` does LMCache's reverse-then-forward two passes;
        (e) Q is indexed along `token_dim` (LMCache indexes axis 0 whatever token_dim is).
    """

    def __init__(self, recompute_ratio: float, check_layer: int = 1, *,
                 delta_rotation: bool = True,
                 reduce_scores: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """Args:
            recompute_ratio: fraction of each request's reused tokens to recompute, in
                [0, 1] (0.15 in the paper).
            check_layer: the layer (0-based) whose K deviation selects the tokens; 1 as
                in LMCache and the paper's code (layer-0 K has no deviation to see).
            delta_rotation: one rotation by the position delta (True), or LMCache's
                reverse + forward encoders (False).
            reduce_scores: with tensor parallelism, a sum over the ranks (vLLM's
                `tensor_model_parallel_all_reduce`) of the float32 `[N]` deviations of
                each rank's head slice, so that every rank selects the same tokens
                (docs/cacheblend.md, "Inside vLLM", tensor parallelism);
                None with one rank.

        Raises:
            ValueError: ratio outside [0, 1] or check_layer not an int >= 0.
        """
        super().__init__(delta_rotation)
        if isinstance(recompute_ratio, bool) or not isinstance(recompute_ratio, (int, float)) \
                or not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be a number in [0, 1] (0.15 recomputes 15% of "
                             f"the reused tokens), got {recompute_ratio!r}")
        if isinstance(check_layer, bool) or not isinstance(check_layer, int) or check_layer < 0:
            raise ValueError(f"check_layer must be an int >= 0, got {check_layer!r}")
        self.recompute_ratio = float(recompute_ratio)
        self.check_layer = check_layer
        self._reduce_scores = reduce_scores

    def blend(self, layer_id, retrieved_k, retrieved_v, valid_mask, original_positions,
              fresh_q, fresh_k, fresh_v, positions, query_start_loc, token_dim) -> BlendOutput:
        """Blend one layer; see the class docstring and `BlendExecutor.blend`.

        Returns:
            BlendOutput; before the check layer local_indices = arange(N) and
            query_start_loc None; at it the selection and the new query_start_loc;
            after it the selection and None. local_indices are int64 on CPU.

        Raises:
            ValueError: inconsistent shapes, dtypes or devices, layers out of order, or
                fresh rows that are not the selection (the message says which).
        """
        valid, original, qsl, token_dim = self._start_layer(
            layer_id, retrieved_k, retrieved_v, valid_mask, original_positions, fresh_q,
            fresh_k, fresh_v, positions, query_start_loc, token_dim)
        num_tokens = valid.numel()
        if layer_id <= self.check_layer:
            self._check_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, num_tokens,
                             f"every token (layers up to the check layer {self.check_layer})")
        if layer_id < self.check_layer:
            return BlendOutput(fresh_q, fresh_k, fresh_v, positions, torch.arange(num_tokens), None)
        if layer_id == self.check_layer:
            mask = torch.ones(num_tokens, dtype=torch.bool)
            if retrieved_k is not None:
                reused_k = self._reused_k(retrieved_k, valid, original, qsl, token_dim)
                mask = self._top_deviation(reused_k, fresh_k, valid, qsl, token_dim)
            if fresh_q is None:  # the caller computes Q of the selection
                selected, new_qsl = self._record_selection(mask, qsl)
                q, selected_positions = None, positions[selected.to(positions.device)]
            else:
                q, selected_positions, selected, new_qsl = self._select(
                    mask, fresh_q, positions, qsl, token_dim)
            logger.debug("cacheblend: layer %d selected %d of %d tokens (%d reused)", layer_id,
                         selected.numel(), num_tokens, int(valid.sum()))
            return BlendOutput(q, fresh_k, fresh_v, selected_positions, selected, new_qsl)
        self._check_selected_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, num_tokens)
        k, v = self._long_kv(retrieved_k, retrieved_v, valid, original, qsl, fresh_k, fresh_v,
                             token_dim)
        return BlendOutput(fresh_q, k, v, positions, self._selected, None)

    def selects_from_fresh_k(self, layer_id: int) -> bool:
        """True at the check layer (`BlendExecutor.selects_from_fresh_k`): fresh_q may be
        None there, and the caller computes Q of the selected rows only."""
        return layer_id == self.check_layer

    def _top_deviation(self, reused_k, fresh_k, valid, qsl, token_dim) -> torch.Tensor:
        """bool [N] cpu: every invalid token, plus per request the ceil(ratio * reused)
        valid tokens of largest mean squared K deviation."""
        other_dims = [d for d in range(fresh_k.dim()) if d != token_dim]
        # float32 [N], cpu: mean squared deviation per token; -inf where nothing reused.
        deviation = ((fresh_k.float() - reused_k.float()) ** 2).mean(dim=other_dims)
        if self._reduce_scores is not None:  # every rank's heads: one selection on all ranks
            deviation = self._reduce_scores(deviation)
        deviation = deviation.cpu()
        deviation = torch.where(valid, deviation, torch.tensor(-math.inf))
        mask = ~valid
        for start, end in zip(qsl[:-1].tolist(), qsl[1:].tolist()):
            num_reused = int(valid[start:end].sum())
            num_pick = math.ceil(round(self.recompute_ratio * num_reused, 9))
            if num_pick:
                mask[start + torch.topk(deviation[start:end], num_pick).indices] = True
        return mask


class LegoLinkImpl(_SelectiveBlend):
    """EPIC's LegoLink (Hu et al., "EPIC: Efficient Position-Independent Caching for
    Serving Large Language Models", ICML 2025): a static selection, from layer 0 on.

    Selected: every token without reused KV, plus the first `legolink_k` tokens of each
    reused segment that does not start its request (clipped to the segment). A reused
    segment starts at a valid token whose original position is 0 and runs while tokens
    stay valid, within its request. Those first tokens were each document's attention
    sink when it was computed alone; recomputing them in context removes the spurious
    sinks. The first segment of a request keeps its KV (it was computed where it is).

    The selection depends on the retrieval only, so it is known before layer 0:
    `fresh_rows(0, ...)` returns it, and a caller that computes Q/K/V for those rows
    only saves the projections of every reused token (the Hugging Face path does). At
    layer 0 the caller passes fresh Q/K/V of those rows, or of every token (the
    selected ones are kept); the output is Q of the selected rows and the long K/V
    (reused, re-rotated, with fresh rows at the selection), and the new query_start_loc.
    Later layers get fresh Q/K/V of the selected rows only, as after CacheBlend's check
    layer.
    """

    def __init__(self, legolink_k: int, *, delta_rotation: bool = True):
        """Args:
            legolink_k: tokens recomputed at the start of each non-first reused segment
                (EPIC uses up to 32; 0 recomputes only tokens without reused KV).
            delta_rotation: as in `CacheBlendImpl`.

        Raises:
            ValueError: legolink_k not an int >= 0.
        """
        super().__init__(delta_rotation)
        if isinstance(legolink_k, bool) or not isinstance(legolink_k, int) or legolink_k < 0:
            raise ValueError("legolink_k must be an int >= 0 (EPIC uses 1 to 32), "
                             f"got {legolink_k!r}")
        self.legolink_k = legolink_k

    def blend(self, layer_id, retrieved_k, retrieved_v, valid_mask, original_positions,
              fresh_q, fresh_k, fresh_v, positions, query_start_loc, token_dim) -> BlendOutput:
        """Blend one layer; see the class docstring and `BlendExecutor.blend`.

        Raises:
            ValueError: as `CacheBlendImpl.blend`.
        """
        valid, original, qsl, token_dim = self._start_layer(
            layer_id, retrieved_k, retrieved_v, valid_mask, original_positions, fresh_q,
            fresh_k, fresh_v, positions, query_start_loc, token_dim)
        num_tokens = valid.numel()
        new_qsl = None
        if layer_id == 0:
            mask = self._segment_heads(valid, original, qsl)
            if fresh_k.shape[token_dim] == num_tokens:  # every token: keep the selected
                self._check_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, num_tokens,
                                 "every token (layer 0)")
                fresh_q, positions, selected, new_qsl = self._select(
                    mask, fresh_q, positions, qsl, token_dim)
                rows = selected.to(fresh_k.device)
                fresh_k = fresh_k.index_select(token_dim, rows)
                fresh_v = fresh_v.index_select(token_dim, rows)
            else:  # the caller computed the rows of fresh_rows(0) only
                selected, new_qsl = self._record_selection(mask, qsl)
                self._check_rows(fresh_q, fresh_k, fresh_v, positions, token_dim,
                                 selected.numel(), f"every token ({num_tokens}) or the "
                                 "selected ones (fresh_rows) at layer 0")
            logger.debug("legolink: selected %d of %d tokens (%d reused)", selected.numel(),
                         num_tokens, int(valid.sum()))
        self._check_selected_rows(fresh_q, fresh_k, fresh_v, positions, token_dim, num_tokens)
        k, v = self._long_kv(retrieved_k, retrieved_v, valid, original, qsl, fresh_k, fresh_v,
                             token_dim)
        return BlendOutput(fresh_q, k, v, positions, self._selected, new_qsl)

    def fresh_rows(self, layer_id, valid_mask, original_positions,
                   query_start_loc) -> torch.Tensor | None:
        """At layer 0, the selection (`BlendExecutor.fresh_rows`): int64 indices, cpu, of
        every token without reused KV and the first legolink_k tokens of each reused
        segment that does not start its request; None at later layers (the previous
        layer's local_indices).
        """
        if layer_id != 0:
            return None
        valid = valid_mask.to("cpu", torch.bool)
        original = original_positions.to("cpu", torch.int64)
        qsl = query_start_loc.to("cpu", torch.int64)
        return mask_to_indices(self._segment_heads(valid, original, qsl))

    def _segment_heads(self, valid, original, qsl) -> torch.Tensor:
        """bool [N] cpu: invalid tokens, plus the first k tokens of each reused segment
        that does not start its request."""
        num_tokens = valid.numel()
        index = torch.arange(num_tokens)
        request_start = torch.zeros(num_tokens, dtype=torch.bool)
        request_start[qsl[:-1][qsl[:-1] < num_tokens]] = True
        segment_start = valid & (original == 0)
        # Index of the last run boundary at or before each token (segment start, invalid
        # token or request start); a valid token is in a segment iff that is a start.
        boundary = segment_start | ~valid | request_start
        last = torch.where(boundary, index, torch.zeros_like(index)).cummax(0).values
        in_segment = valid & segment_start[last]
        head = in_segment & (index - last < self.legolink_k) & ~request_start[last]
        return ~valid | head
