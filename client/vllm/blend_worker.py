"""The worker side of CacheBlend inside vLLM: blend in `start_load_kv`, store documents.

Why this file exists: for each blend request of a step (client/vllm/blend_scheduler.py
claimed its documents as a synchronous external hit, so vLLM calls `start_load_kv`
before the forward and computes only the tail itself), this module:

1. pins every cached segment of the claimed prompt (`SPTBlendRetriever`: each segment
   is its own chunk chain, stored token-major per layer from position 0);
2. runs the model's own modules layer by layer (client/vllm/blend_layers.py) with a
   `CacheBlendImpl` or `LegoLinkImpl` executor (lmcached.client.blend, shared with the
   Hugging Face path), writing each layer's blended K/V into the request's paged blocks
   with the backend's `do_kv_cache_update` (slot = block_id * block_size + pos %
   block_size; vllm/model_executor/layers/attention/attention.py ~l.724 in 0.32.0);
3. releases the pins (every path), then queues every segment that was not cached, to be
   computed alone, from position 0, and stored for any later request in any process: as
   many per step as fit in `store_tokens_per_step` tokens (at least one), so that
   a first meeting of a long document set is spread over steps as vLLM's chunked
   prefill spreads a prompt, instead of stalling the decodes of one step.

A blend that fails (the daemon went away, a pin of an ended session, a model the loop
does not reproduce) reports the claimed blocks as load errors: vLLM recomputes them
exactly (`kv_load_failure_policy="recompute"`).

With tensor parallelism each rank blends its own head slice from its own namespace,
and the model's row-parallel layers all-reduce over the rows each rank computes, so the
ranks must compute the same rows, in step: they agree on which tokens each segment
reuses (a chunk missing on one rank is a miss on all), sum the deviation scores over
their heads before top-k (`CacheBlendImpl(reduce_scores=)`), and fail together when one
rank cannot read a layer (otherwise one rank leaves the layer loop while the others
wait in its all-reduces). vllm-free: the connector hands in the collectives.
"""

import collections
import dataclasses
from typing import Callable

import numpy as np
import torch

from lmcached.client.blend.executor import CacheBlendImpl, LegoLinkImpl
from lmcached.client.blend.interfaces import BlendRetrieverResult, BlendRetrieverTask
from lmcached.client.blend.retriever import SPTBlendRetriever
from lmcached.client.blend.rope import LlamaRotary
from lmcached.client.engine import CacheEngine
from lmcached.client.layout import KVLayout
from lmcached.client.vllm.blend_flash import paged_flash_attention
from lmcached.client.vllm.blend_layers import check_blend_model, run_blended_layers
from lmcached.client.vllm.blend_params import BlendSpec
from lmcached.client.vllm.specs import ConnectorSettings
from lmcached.wire.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """The collectives over vLLM's TP group a rank's blend needs (the connector builds
    them from `get_tp_group()`); every rank calls them in the same order.

    Attributes:
        sum_scores: float32 `[N]` (any device) -> its sum over the ranks, same device.
        min_flags: int64 `[n]`, cpu -> its element-wise minimum over the ranks.
    """

    sum_scores: Callable[[torch.Tensor], torch.Tensor]
    min_flags: Callable[[torch.Tensor], torch.Tensor]


MAX_PENDING_STORES = 256  # queued document segments; a first meeting beyond them is not
#                          stored (counted): the queue drains at least one per step


def rotary_of(hf_config) -> LlamaRotary:
    """The model's RoPE as a delta rotation, from its config (`LlamaRotary.from_config`).

    Raises:
        ValueError: a RoPE type a delta rotation is not exact for (dynamic, yarn, ...).
    """
    return LlamaRotary.from_config(hf_config)


class BlendWorker:
    """One TP rank's CacheBlend: blends claimed prompts, stores uncached documents.

    Args:
        settings: the connector's settings (daemon, chunk size, block size).
        segment_layout: this rank's namespace of document segments (fmt "vllm",
            `[num_layers, 2, num_tokens, num_kv_heads, head_size]`, model dtype;
            client/blend/segments.py, shared with the Hugging Face path).
        hf_config: the model's Hugging Face config (RoPE parameters).
        tp_group: the TP group's collectives; None with one rank.
        store_tokens_per_step: segment tokens one step may compute alone and store
            (at least one segment per step); the connector passes vLLM's
            `max_num_batched_tokens`.

    Attributes:
        num_blended_requests / num_reused_tokens / num_recomputed_tokens: blends done,
            tokens whose cached K/V were blended in, rows computed through every layer.
        num_stored_segments: document segments computed alone and stored.
        num_skipped_stores: queued segments found stored meanwhile (by another request
            or process) and not computed again.
        num_dropped_stores: segments not queued, MAX_PENDING_STORES being queued.
        num_failed_blends: blends that failed and were left to vLLM to recompute.
    """

    def __init__(self, settings: ConnectorSettings, segment_layout: KVLayout,
                 hf_config, tp_group: TensorParallelGroup | None = None,
                 store_tokens_per_step: int = 2048) -> None:
        self.settings = settings
        self._tp_group = tp_group
        self.store_tokens_per_step = store_tokens_per_step
        # (token ids int64 [n] cpu, cache salt), in the order every TP rank queued them
        self._pending_stores: collections.deque = collections.deque()
        self.engine = CacheEngine.connect(segment_layout, settings.socket,
                                          settings.daemon_name, timeout_s=settings.timeout_s)
        self._hf_config = hf_config
        self.num_blended_requests = 0
        self.num_reused_tokens = 0
        self.num_recomputed_tokens = 0
        self.num_stored_segments = 0
        self.num_skipped_stores = 0
        self.num_dropped_stores = 0
        self.num_failed_blends = 0
        self._load_errors: set[int] = set()

    @property
    def num_pending_stores(self) -> int:
        """Segments queued to be computed alone and stored in a later step."""
        return len(self._pending_stores)

    def run(self, specs: list[BlendSpec], model) -> None:
        """Blend (or only store the documents of) each request of the step, before the
        forward, then store queued segments within the step's budget (`store_pending`).
        Never raises: a failure becomes load errors (vLLM recomputes)."""
        for spec in specs:
            try:
                with torch.inference_mode():
                    missing = self._run_one(spec, model)
            except Exception as exc:  # noqa: BLE001 - served by vLLM's recompute instead
                logger.warning("lmcached blend of request %s failed, vLLM recomputes its "
                               "prompt: %s: %s", spec.req_id, type(exc).__name__, exc)
                self.num_failed_blends += 1
                if not spec.store_only:
                    self._load_errors.update(_claimed_blocks(spec, self.settings.block_size))
                continue
            self._queue_stores(missing, spec.cache_salt)
        self.store_pending(model)

    def _queue_stores(self, segments: list[torch.Tensor], salt: str | None) -> None:
        """Queue segments to store, each once (a burst of requests meeting the same new
        documents queues them once), at most MAX_PENDING_STORES. Every TP rank makes the
        same decisions (same specs, same queue)."""
        pending = {(queued_salt, queued.numpy().tobytes())
                   for queued, queued_salt in self._pending_stores}
        for segment in segments:
            key = (salt, segment.numpy().tobytes())
            if key in pending:
                continue
            if len(self._pending_stores) >= MAX_PENDING_STORES:
                if not self.num_dropped_stores:
                    logger.warning("lmcached blend: %d document segments are queued to be "
                                   "stored; new ones are not stored until the queue drains "
                                   "(raise max_num_batched_tokens to store more per step)",
                                   MAX_PENDING_STORES)
                self.num_dropped_stores += 1
                continue
            pending.add(key)
            self._pending_stores.append((segment, salt))

    def store_pending(self, model) -> None:
        """Compute alone and store queued segments, oldest first, as many as fit in
        `store_tokens_per_step` tokens (at least one); call before the forward of every
        step while segments are queued. Every TP rank stores the same segments in the
        same step (their queues are built from the same specs). Never raises: a document
        not stored is only a later miss."""
        num_tokens = 0
        while self._pending_stores and (
                num_tokens == 0
                or num_tokens + self._pending_stores[0][0].numel() <= self.store_tokens_per_step):
            segment, salt = self._pending_stores.popleft()
            try:
                if self._stored_meanwhile(segment, salt):
                    self.num_skipped_stores += 1
                    continue
                num_tokens += segment.numel()
                with torch.inference_mode():
                    self._store_segment(model, segment, salt)
            except Exception as exc:  # noqa: BLE001
                logger.warning("lmcached blend: storing a document failed: %s: %s",
                               type(exc).__name__, exc)

    def counters(self) -> dict[str, int]:
        """The counters so far, as vLLM's connector stats carry them
        (client/vllm/connector_stats.py), named as the attributes without `num_`."""
        return {"blended_requests": self.num_blended_requests,
                "reused_tokens": self.num_reused_tokens,
                "recomputed_tokens": self.num_recomputed_tokens,
                "stored_segments": self.num_stored_segments,
                "skipped_stores": self.num_skipped_stores,
                "dropped_stores": self.num_dropped_stores,
                "failed_blends": self.num_failed_blends}

    def take_load_errors(self) -> set[int]:
        """vLLM blocks of failed blends since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _executor(self, spec: BlendSpec):
        params = spec.params
        reduce_scores = self._tp_group.sum_scores if self._tp_group else None
        executor = (CacheBlendImpl(params.recompute_ratio, reduce_scores=reduce_scores)
                    if params.strategy == "cacheblend" else LegoLinkImpl(params.legolink_k))
        executor.set_positional_encoder(rotary_of(self._hf_config).encoder)
        return executor

    def _run_one(self, spec: BlendSpec, model) -> list[torch.Tensor]:
        """Blend one request (unless store-only); returns the token ids (int64 `[n]`,
        cpu) of its segments that were not fully cached, to store."""
        if model is None:
            raise ValueError("no blend-aware model in this process: start vLLM with "
                             "--hf-overrides '{\"architectures\": [\"LMCachedLlamaForCausalLM\"]}'")
        check_blend_model(model)
        ids = torch.from_numpy(np.asarray(spec.tokens, dtype=np.int64))
        retriever = SPTBlendRetriever(spec.params.separator, self.engine,
                                      device=next(model.parameters()).device)
        with self._pin(retriever, ids, spec.cache_salt) as task:
            valid = task.valid_mask.clone()
            segments = list(task.segments)
            if not spec.store_only:
                sink = self._paged_writer(spec, model)
                attention = paged_flash_attention(model, spec.block_ids)  # None: positions_attention
                layers = task if self._tp_group is None else _InStep(task, self._tp_group)
                run = run_blended_layers(model, ids, layers, self._executor(spec), sink,
                                         attention)
                self.num_blended_requests += 1
                self.num_reused_tokens += run.num_reused_tokens
                self.num_recomputed_tokens += run.recomputed_indices.numel()
        return [ids[start:end] for start, end in segments if not bool(valid[start:end].all())]

    def _pin(self, retriever: SPTBlendRetriever, ids: torch.Tensor, salt: str | None):
        """Pin every segment's cached chunks; with TP, every rank keeps only the tokens
        all ranks found (a segment's reused prefix is the shortest of the ranks')."""
        group = self._tp_group
        try:
            task = retriever.new_request(ids, torch.tensor([0, ids.numel()]), salt)
        except Exception:
            if group is not None:  # the others are waiting for this rank's answer
                group.min_flags(torch.zeros(ids.numel() + 1, dtype=torch.int64))
            raise
        if group is None:
            return task
        flags = group.min_flags(torch.cat([torch.ones(1, dtype=torch.int64),
                                           task.valid_mask.to(torch.int64)]))
        if not int(flags[0]):
            task.release()
            raise RuntimeError("another tensor-parallel rank could not pin the documents")
        task.valid_mask &= flags[1:].bool()  # shared by every result() of the task
        return task

    def _paged_writer(self, spec: BlendSpec, model):
        """A sink writing each layer's K/V of positions [num_local, end) into the
        request's paged blocks (`do_kv_cache_update`)."""
        block_size = self.settings.block_size
        positions = torch.arange(spec.num_local_tokens, len(spec.tokens))
        block_ids = torch.tensor(spec.block_ids, dtype=torch.int64)
        slots = block_ids[positions // block_size] * block_size + positions % block_size
        layers = model.model.layers
        device = next(model.parameters()).device
        slots = slots.to(device)
        rows = positions.to(device)

        def write(layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
            attention = layers[layer_id].self_attn.attn
            attention.impl.do_kv_cache_update(attention, k[rows].contiguous(),
                                              v[rows].contiguous(), attention.kv_cache, slots)

        return write

    def _stored_meanwhile(self, tokens: torch.Tensor, salt: str | None) -> bool:
        """Whether a queued segment is stored by now on every TP rank (another request
        or process met the document since it was queued): one LOOKUP, and with TP one
        all-reduce, so that every rank skips it or none does (the forward that stores it
        runs the model's collectives)."""
        try:
            found = int(self.engine.lookup(tokens, cache_salt=salt) >= tokens.numel())
        except Exception:  # noqa: BLE001 - not known stored: compute it (every rank agrees)
            found = 0
        if self._tp_group is not None:
            found = int(self._tp_group.min_flags(torch.tensor([found], dtype=torch.int64))[0])
        return bool(found)

    def _store_segment(self, model, tokens: torch.Tensor, salt: str | None) -> None:
        """Compute one segment alone from position 0 (every row, every layer) and store
        it under the request's cache salt, `[num_layers, 2, num_tokens, num_kv_heads,
        head_size]`."""
        layers: list[torch.Tensor] = []

        def keep(layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
            layers.append(torch.stack((k, v)).cpu())  # [2, T, kv_heads, head_size]

        # Nothing retrieved: every row through every layer, as the model's forward (the
        # same collectives on every TP rank; only the store below is this rank's own).
        with SPTBlendRetriever(0, self.engine).empty_request(tokens.numel()) as task:
            run_blended_layers(model, tokens, task, CacheBlendImpl(1.0), keep)
        if self.engine.store(tokens, torch.stack(layers), cache_salt=salt):
            self.num_stored_segments += 1

    def shutdown(self) -> None:
        """Close the daemon session."""
        self.engine.close()


def _claimed_blocks(spec: BlendSpec, block_size: int) -> set[int]:
    """vLLM block ids holding positions [num_local, end) of a blend request."""
    first = spec.num_local_tokens // block_size
    last = -(-len(spec.tokens) // block_size)
    return set(spec.block_ids[first:last])


class _InStep(BlendRetrieverTask):
    """A task whose layers every TP rank reads in step: a layer one rank cannot read
    (`PinsLost`, the daemon gone) fails on every rank, before any of them runs the
    layer's all-reduces."""

    def __init__(self, task: BlendRetrieverTask, group: TensorParallelGroup) -> None:
        self._task = task
        self._group = group

    def result(self, layer_id: int) -> BlendRetrieverResult:
        """The wrapped task's layer, or the error of whichever rank failed to read it."""
        error: Exception | None = None
        try:
            result = self._task.result(layer_id)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
        if not int(self._group.min_flags(torch.tensor([int(error is None)]))[0]):
            raise error or RuntimeError(f"another tensor-parallel rank could not read "
                                        f"layer {layer_id} of the documents")
        return result
