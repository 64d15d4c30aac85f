"""A transformers attention implementation for prompts whose first tokens are cached.

Why this file exists: when the queries of a forward follow cached keys (a prefill after
`generate_with_cache` retrieved a prefix), transformers' "sdpa" implementation builds an
explicit boolean mask and PyTorch's CPU kernel with a mask runs about twice as slow as
its causal kernel, so a short cache hit would make the first token slower than no cache
at all. This module registers "lmcached_sdpa" with transformers' `AttentionInterface`
and `AttentionMaskInterface`: where the queries are the last tokens of the keys with no
padding, no mask is built and the attention runs `lmcached.client.attention`
(unmasked prefix + causal square, merged by log-sum-exp); everything else (padding,
other mask patterns, a single query, a square) goes to transformers' own sdpa path
unchanged.

    with prefix_attention(model):      # what generate_with_cache does
        model(ids[:, num_cached:], **{CACHE_ARG: cache})  # hf.CACHE_ARG

or load the model with `attn_implementation=LMCACHED_ATTENTION` after importing this
module.
"""

import contextlib

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from lmcached.client.attention import attend_causal_suffix

LMCACHED_ATTENTION = "lmcached_sdpa"


def prefix_causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0,
                       kv_offset=0, mask_function=causal_mask_function, attention_mask=None,
                       local_size=None, **kwargs) -> torch.Tensor | None:
    """The mask of "lmcached_sdpa": None where the queries are the last `q_length` of
    the keys, causal, without padding (the attention then needs no mask); else
    transformers' `sdpa_mask`, always materialized (never None), so that None keeps its
    one meaning. Same signature as `sdpa_mask`.

    Returns:
        None, or a bool `[batch_size, 1, q_length, kv_length]` mask (True: attend).
    """
    is_suffix = (mask_function is causal_mask_function and local_size is None
                 and isinstance(q_offset, int) and isinstance(kv_offset, int)
                 and kv_offset == 0 and q_offset + q_length == kv_length)
    if is_suffix and (attention_mask is None or bool(attention_mask[:, :kv_length].all())):
        return None
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, **kwargs)


def prefix_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs):
    """The attention of "lmcached_sdpa" (transformers' attention-function signature).

    Args:
        module: the attention module (its `is_causal` is read when `is_causal` is None).
        query: `[B, num_heads, q, head_size]`; key, value: `[B, num_kv_heads, kv, head_size]`.
        attention_mask: None (from `prefix_causal_mask`: the queries are the last q of
            the kv keys, causal), or a mask passed on to transformers' sdpa.
        dropout, scaling, is_causal, kwargs: as `sdpa_attention_forward`.

    Returns:
        (attn_output `[B, q, num_heads, head_size]`, None), as `sdpa_attention_forward`.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length, kv_length = query.shape[2], key.shape[2]
    if (attention_mask is not None or not causal or dropout or q_length in (1, kv_length)
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = attend_causal_suffix(query, key, value, scale=scaling)  # [B, heads, q, head_size]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LMCACHED_ATTENTION, prefix_attention_forward)
AttentionMaskInterface.register(LMCACHED_ATTENTION, prefix_causal_mask)


@contextlib.contextmanager
def prefix_attention(model: PreTrainedModel):
    """Run the model with "lmcached_sdpa" inside the block if it uses "sdpa" (the
    default); any other implementation the caller chose (eager, flash) is kept.
    The previous implementation is restored on exit, also on error.

    Args:
        model: a transformers model.
    """
    config = model.config
    previous = config._attn_implementation
    if previous != "sdpa":
        yield
        return
    config._attn_implementation = LMCACHED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
