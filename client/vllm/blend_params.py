"""What a vLLM request asks of CacheBlend, and why a request is served without it.

Why this file exists: a request asks for blending through vLLM's per-request KV
transfer parameters (`Request.kv_transfer_params`, filled from the OpenAI server's
`kv_transfer_params` or `SamplingParams(extra_args={"kv_transfer_params": ...})`,
vllm/v1/request.py ~l.120 in 0.32.0)::

    {"lmcached_blend": {"separator": 128002, "recompute_ratio": 0.15}}
    {"lmcached_blend": {"separator": 128002, "strategy": "legolink", "legolink_k": 16}}

Anything refused here (`REFUSALS`) is
served as a normal prefill, and the reason is counted: blended KV enters vLLM's own
prefix cache as if it were exact, so a blend request must carry a `cache_salt` of its
own, or a later plain request could reuse blended blocks. vllm-free: the request is read
through the attributes vLLM 0.32.0 gives it.
"""

import dataclasses

import numpy as np

BLEND_KEY = "lmcached_blend"
STRATEGIES = ("cacheblend", "legolink")
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are int32 in vLLM; a separator above is no token
MAX_LEGOLINK_K = 1 << 20  # tokens recomputed per segment: more than any context holds

# Why a request that asked for blending was served normally (counter names).
REFUSALS = ("unsalted", "bad_params", "lora", "multimodal", "prompt_embeds",
            "no_model", "rope", "one_segment", "local_hit", "daemon_unavailable")


@dataclasses.dataclass(frozen=True)
class BlendParams:
    """One request's blending parameters (validated).

    Attributes:
        separator: the separator's token id; the prompt is cut after each one.
        strategy: "cacheblend" (Yao et al., EuroSys 2025) or "legolink" (EPIC, Hu et
            al., ICML 2025).
        recompute_ratio: "cacheblend": fraction of reused tokens recomputed, in [0, 1].
        legolink_k: "legolink": tokens recomputed at the start of each reused segment.
    """

    separator: int
    strategy: str = "cacheblend"
    recompute_ratio: float = 0.15
    legolink_k: int = 16


def blend_params(request) -> tuple[BlendParams | None, str | None]:
    """Read a request's blend parameters.

    Args:
        request: a vLLM Request.

    Returns:
        (params, None) for a request to blend; (None, None) for a request that did not
        ask; (None, reason) for one that asked and is served normally (`REFUSALS`).
    """
    transfer = getattr(request, "kv_transfer_params", None)
    if not isinstance(transfer, dict) or BLEND_KEY not in transfer:
        return None, None
    params = parse_blend_params(transfer[BLEND_KEY])
    if params is None:
        return None, "bad_params"  # blend_params_problem says why
    if getattr(request, "cache_salt", None) is None:
        return None, "unsalted"
    if getattr(request, "lora_request", None) is not None:
        return None, "lora"
    if getattr(request, "mm_features", None):
        return None, "multimodal"
    if (getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "prompt_token_ids", None) is None):
        return None, "prompt_embeds"
    return params, None


def parse_blend_params(raw) -> BlendParams | None:
    """`BlendParams` from the request's `lmcached_blend` dict, or None when it is not one
    (`blend_params_problem` says why)."""
    if blend_params_problem(raw) is not None:
        return None
    return BlendParams(int(raw["separator"]), raw.get("strategy", "cacheblend"),
                       float(raw.get("recompute_ratio", 0.15)), int(raw.get("legolink_k", 16)))


def blend_params_problem(raw) -> str | None:
    """What is wrong with a request's `lmcached_blend` value, or None when it is valid.

    Every number is bounded here, where it enters, so that nothing downstream (numpy's
    int64 comparisons in the scheduler, torch in the worker's forward) meets a value
    it cannot hold: `separator` an int in [0, MAX_TOKEN_ID], `legolink_k` an int in
    [0, MAX_LEGOLINK_K], `recompute_ratio` a finite number in [0, 1], `strategy` one of
    STRATEGIES, and no other key (a typo is not silently ignored).

    Returns:
        None, or one line naming the field, the value (shortened) and what is allowed.
    """
    if not isinstance(raw, dict):
        return f"lmcached_blend is a {type(raw).__name__}, not a dict"
    unknown = set(raw) - {"separator", "strategy", "recompute_ratio", "legolink_k"}
    if unknown:
        return (f"unknown key(s) {sorted(map(str, unknown))[:4]}: the keys are separator, "
                "strategy, recompute_ratio, legolink_k")
    separator = raw.get("separator")
    if not _is_int(separator) or not 0 <= separator <= MAX_TOKEN_ID:
        return f"separator {_short(separator)} is not a token id (an int in [0, {MAX_TOKEN_ID}])"
    strategy = raw.get("strategy", "cacheblend")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        return f"strategy {_short(strategy)} is not one of {STRATEGIES}"
    ratio = raw.get("recompute_ratio", 0.15)
    # NaN and the infinities fail the range test.
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        return f"recompute_ratio {_short(ratio)} is not a number in [0, 1]"
    legolink_k = raw.get("legolink_k", 16)
    if not _is_int(legolink_k) or not 0 <= legolink_k <= MAX_LEGOLINK_K:
        return f"legolink_k {_short(legolink_k)} is not an int in [0, {MAX_LEGOLINK_K}]"
    return None


def _short(value) -> str:
    """`value`'s repr, cut to 40 characters, for a log line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class BlendSpec:
    """One blend request of a step (scheduler -> workers).

    Attributes:
        req_id: vLLM request id.
        params: its BlendParams.
        tokens: int64 `[end]`: the prompt up to the start of its last segment (the
            claimed part; vLLM computes the rest).
        num_local_tokens: vLLM's own prefix-cache hit: positions below are not written.
        block_ids: the request's vLLM block ids, covering `[0, end)`.
        store_only: nothing was claimed (no segment cached yet): only compute and store
            the segments.
        cache_salt: the request's cache salt: its documents are stored and looked up
            under it (blended KV never crosses tenants).
    """

    req_id: str
    params: BlendParams
    tokens: np.ndarray
    num_local_tokens: int
    block_ids: list[int]
    store_only: bool = False
    cache_salt: str | None = None
