"""blend_prefill as it was before its speed-ups (the dense-mask path), in this same process.

Why this file exists: CacheBlend's and LegoLink's speed-up over a full prefill is measured
against "today's" path (the dense-mask attention), before/after in one run, with
quality unchanged. Today's path is the layer loop, executors and RoPE re-rotation of
commit `BASELINE_REV` (loaded here from git, `git show`, as standalone modules: nothing of
them stays in the package), with the selected rows' attention as SDPA over the boolean
mask (`masked_attention`, what hf_blend ran before client/attention.py). Inside
`baseline.active()`, `lmcached.client.hf.blend_prefill` (client/hf_cacheblend.py) runs
that path; outside, the working tree's.

    baseline = Baseline()                  # git show, once
    with baseline.active():
        before = blend_prefill(model, engine, ids, sep)
"""

import contextlib
import dataclasses
import os
import subprocess
import sys
import types
from typing import Iterator

import torch
import torch.nn.functional as F

from benchmarks import REPO
from lmcached.client import hf_cacheblend

# the commit before the blend speed-ups: today's executors, re-rotation and layer loop.
BASELINE_REV = "3775bbb"


def masked_attention(query, key, value, positions, scale=None, plan=None):
    """The attention before the speed-ups: SDPA over repeat_kv'd K/V with the boolean mask
    key j <= positions[i] (`attend_at_positions`' signature and shapes; `plan` unused)."""
    groups = query.shape[1] // key.shape[1]
    mask = torch.arange(key.shape[2], device=query.device)[None, :] <= \
        positions.to(query.device)[:, None]
    return F.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
        attn_mask=mask[None, None], scale=scale)


def _load(rev: str, path: str, name: str) -> types.ModuleType:
    """Module `name` from the file `path` as of git revision `rev` of this repository."""
    try:
        source = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"cannot read {path} at {rev} (needs this git checkout with its "
                           f"history): {getattr(exc, 'stderr', '') or exc}") from None
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


class _HeadMajorTask:
    """A retrieval task whose layers' K/V are handed out head-major, `[num_kv_heads,
    num_tokens, head_size]`, as today's layer loop read them: documents are now stored
    token-major (client/blend/segments.py), which changes no byte of K/V."""

    def __init__(self, task) -> None:
        self._task = task

    def result(self, layer_id: int):
        result = self._task.result(layer_id)
        return dataclasses.replace(
            result, k=None if result.k is None else result.k.transpose(0, 1),
            v=None if result.v is None else result.v.transpose(0, 1))


def _fed_head_major(run_blended_layers):
    """Today's `run_blended_layers`, given the head-major K/V it expects."""
    def run(model, input_ids, task, executor):
        return run_blended_layers(model, input_ids, _HeadMajorTask(task), executor)
    return run


class Baseline:
    """Today's blend path (see the module doc), loaded once from git revision `rev`."""

    def __init__(self, rev: str = BASELINE_REV):
        self.rev = rev
        rope = _load(rev, "client/blend/rope.py", "baseline_blend_rope")
        executor = _load(rev, "client/blend/executor.py", "baseline_blend_executor")
        layers = _load(rev, "client/hf_blend.py", "baseline_hf_blend")
        layers.attend_at_positions = masked_attention
        self._swap = {"run_blended_layers": _fed_head_major(layers.run_blended_layers),
                      "CacheBlendImpl": executor.CacheBlendImpl,
                      "LegoLinkImpl": executor.LegoLinkImpl,
                      "LlamaRotary": rope.LlamaRotary}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """`hf.blend_prefill` runs today's path inside the block (not thread-safe)."""
        saved = {name: getattr(hf_cacheblend, name) for name in self._swap}
        for name, value in self._swap.items():
            setattr(hf_cacheblend, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(hf_cacheblend, name, value)
