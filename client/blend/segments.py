"""The one namespace of CacheBlend's document segments, for every process on the node.

Why this file exists: a document computed alone from position 0 is the same KV whichever
engine computed it, so the vLLM blend worker (client/vllm/blend_worker.py) and a Hugging
Face process (`store_segments` / `blend_prefill`, client/hf.py) store and find documents
in one namespace, defined here once. Its layout is token-major per layer (fmt "vllm"),
independent of vLLM's paged format and of transformers' head-major DynamicCache::

    record KV of one segment chunk: [num_layers, 2, num_tokens, num_kv_heads, head_size]

Two processes share documents when every field of the layout is equal: the model name
(`model_name`: vLLM's `kv_connector_extra_config.namespace`, default the model as given
to vLLM; `model_name=` on the Hugging Face side, default `config.name_or_path`), the
chunk size, the geometry and dtype, the TP size and rank; and when their requests carry
the same cache salt (it enters each segment's chain at its root). Any difference is a
different namespace (the layout fingerprint in every record header covers the geometry
and dtype): a miss, never another model's bytes.

Where documents live, one rule for every reader and writer: a document is the KV of its
tokens computed alone from position 0, stored as its own chunk chain. Writers
(`store_segments`, vLLM's blend worker) put it in the segment namespace. Readers
(`SPTBlendRetriever`, hence `blend_prefill` and vLLM's blend worker) look for it in the
two namespaces of the model that may hold it (`document_layouts`): the engine's own
first, then the other one; the other is the model's prefix namespace (Hugging Face
format, `prefix_layout_of`), where LMCache's seed API puts a document
(`engine.store(segment_tokens, kv)` on an engine of `layout_for_model`). The chains are
the same KV under either namespace (hashes from position 0, token ids checked), only the
byte order differs; the reader copies it into its own format.
"""

import dataclasses

import torch

from lmcached.client.layout import KVLayout

# Marks the namespace as documents computed alone from position 0 by the model's own
# modules (not a vLLM plain connector's opaque pages, not a prefix of transformers').
SEGMENTS_TAG = "|blend-segments"


def segment_layout(model_name: str, num_layers: int, num_kv_heads: int, head_size: int,
                   dtype: str | torch.dtype, chunk_size: int = 256, world_size: int = 1,
                   worker_id: int = 0) -> KVLayout:
    """The namespace of the document segments of one model (one TP rank's head slice).

    Args:
        model_name: the model's name, the same in every process that shares documents.
        num_layers: decoder layers.
        num_kv_heads: KV heads of this rank (all of them at world_size 1).
        head_size: elements per head.
        dtype: the KV dtype (the model's dtype).
        chunk_size: tokens per chunk.
        world_size: tensor-parallel size; worker_id: this rank.

    Returns:
        A KVLayout of fmt "vllm" (`[num_layers, 2, num_tokens, num_kv_heads, head_size]`)
        named `model_name + SEGMENTS_TAG`.

    Raises:
        ValueError: a field out of range (see KVLayout).
    """
    return KVLayout(model_name + SEGMENTS_TAG, num_layers, num_kv_heads, head_size, dtype,
                    chunk_size, fmt="vllm", world_size=world_size, worker_id=worker_id)


def segment_model_name(layout: KVLayout) -> str | None:
    """The model name of a segment namespace (`segment_layout`), or None for any other
    layout."""
    if layout.fmt != "vllm" or not layout.model_name.endswith(SEGMENTS_TAG):
        return None
    return layout.model_name.removesuffix(SEGMENTS_TAG)


def segment_layout_of(layout: KVLayout) -> KVLayout:
    """The segment namespace of the model and geometry of `layout` (e.g. a Hugging Face
    layout from `layout_for_model`): the same name, chunk size, heads, dtype and rank.

    Returns:
        `layout` itself when it is a segment namespace already.
    """
    if segment_model_name(layout) is not None:
        return layout
    fields = dataclasses.asdict(layout)
    del fields["fmt"]
    return segment_layout(**fields)


def prefix_layout_of(layout: KVLayout) -> KVLayout:
    """The prefix namespace (Hugging Face format, as `layout_for_model` makes it) of the
    model and geometry of a segment namespace: where `engine.store(segment, kv)` on a
    Hugging Face engine of that model puts a document.

    Returns:
        `layout` itself when it is not a segment namespace.
    """
    name = segment_model_name(layout)
    if name is None:
        return layout
    fields = dataclasses.asdict(layout)
    fields.update(model_name=name, fmt="huggingface")
    return KVLayout(**fields)


def document_layouts(layout: KVLayout) -> tuple[KVLayout, KVLayout]:
    """The two namespaces that may hold the documents of `layout`'s model, in the order a
    reader given an engine of `layout` searches them: its own, then the other (the
    segment namespace, or for a segment namespace the model's prefix namespace)."""
    if segment_model_name(layout) is None:
        return layout, segment_layout_of(layout)
    return layout, prefix_layout_of(layout)
