"""CacheBlend: reuse the cached KV of every retrieved document, not only the prefix
(import name `lmcached.client.blend`, folder `client/blend/`).

RAG prompts join a system prompt, documents and a question with a separator token.
Each segment's KV is stored on its own, from position 0; a prompt reuses it wherever the
segment appears, moves its K to the new positions, and recomputes a few tokens so the
documents attend to each other (Yao et al., "CacheBlend", EuroSys 2025; EPIC's LegoLink,
Hu et al., ICML 2025). Names and semantics follow LMCache's `lmcache.blend`.

What lives here:
    interfaces.py   BlendExecutor, BlendRetriever, BlendRetrieverTask (ABCs),
                    BlendOutput, BlendRetrieverResult, PositionalEncoder
    executor.py     CacheBlendImpl, LegoLinkImpl (which tokens each layer recomputes);
                    create_index, indices_to_mask, mask_to_indices
    retriever.py    SPTBlendRetriever, split_on_spt (per-segment lookups on the daemon,
                    one layer of K/V at a time from the pinned arena blocks)
    layer_loop.py   run_layers over a DecoderAdapter: the one CacheBlend layer loop
                    (its adapters: lmcached.client.hf_blend, lmcached.client.vllm.blend_layers)
    rope.py         LlamaRotary (RoPE re-rotation by a position delta, in fp32)
    segments.py     segment_layout, segment_layout_of (the one namespace of documents,
                    token-major, shared by the vLLM blend worker and the Hugging Face path)

What it may import: torch, numpy and lmcached.client's core (engine, records, kv_io,
cuda, hashing) and lmcached.wire.logger; never transformers nor vllm (the
decoder adapters that know their modules live beside them: `lmcached.client.hf_blend`,
`lmcached.client.vllm.blend_layers`).
"""

from lmcached.client.blend.executor import (
    CacheBlendImpl,
    LegoLinkImpl,
    create_index,
    indices_to_mask,
    mask_to_indices,
)
from lmcached.client.blend.interfaces import (
    BlendExecutor,
    BlendOutput,
    BlendRetriever,
    BlendRetrieverResult,
    BlendRetrieverTask,
    PositionalEncoder,
)
from lmcached.client.blend.rope import LlamaRotary
from lmcached.client.blend.retriever import SPTBlendRetriever, split_on_spt
from lmcached.client.blend.segments import segment_layout, segment_layout_of

__all__ = [
    "BlendExecutor",
    "BlendOutput",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "CacheBlendImpl",
    "LegoLinkImpl",
    "LlamaRotary",
    "PositionalEncoder",
    "SPTBlendRetriever",
    "create_index",
    "indices_to_mask",
    "mask_to_indices",
    "segment_layout",
    "segment_layout_of",
    "split_on_spt",
]
