"""Where CacheBlend's documents live: one rule for every writer and reader.

A document stored LMCache's way (`engine.store(segment, kv)` from position 0 on an engine
of `layout_for_model`, as `SPTBlendRetriever`'s docstring says) or by `store_segments`
(the segment namespace) is found by `blend_prefill` and by `SPTBlendRetriever` given
that same engine: every combination reuses the document, and the bytes read are the
bytes stored. Checked on a tiny random-weight Llama against a real daemon.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import CacheEngine  # noqa: E402
from lmcached.client.blend.retriever import SPTBlendRetriever  # noqa: E402
from lmcached.client.hf import (  # noqa: E402
    blend_prefill,
    layout_for_model,
    model_cache,
    segment_layout_for_model,
    store_segments,
)

VOCAB, SPT, NUM_LAYERS, CHECK_LAYER = 400, 399, 4, 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


def tokens(num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SPT, (num_tokens,), generator=torch.Generator().manual_seed(seed))


DOC = torch.cat([tokens(36, 1), torch.tensor([SPT])])  # 2 full chunks of 16 and a partial one
QUESTION = tokens(9, 2)
PROMPT = torch.cat([DOC, QUESTION])


@torch.inference_mode()
def alone(model, ids: torch.Tensor):
    """The DynamicCache of `ids` computed alone from position 0."""
    return model_cache(model(ids[None], use_cache=True))


def store(how: str, model, engine: CacheEngine):
    """Store DOC through one API; returns its cache computed alone (the bytes stored)."""
    cache = alone(model, DOC)
    if how == "engine.store":  # LMCache's seed API, on the Hugging Face engine itself
        assert engine.store(DOC, cache) == 3
    else:
        assert store_segments(model, engine, DOC, SPT) == len(DOC)
    return cache


@pytest.mark.parametrize("how", ["engine.store", "store_segments"])
def test_blend_prefill_reuses_a_document_whichever_api_stored_it(model, daemon, how):
    layout = layout_for_model(model, chunk_size=16, model_name=f"docs-prefill-{how}")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        stored = store(how, model, engine)
        prefill = blend_prefill(model, engine, PROMPT, SPT, recompute_ratio=0.0)
    assert prefill.num_reused_tokens == len(DOC) > 0
    assert prefill.num_recomputed_tokens == len(QUESTION)
    # After the check layer the document's rows are the stored K/V (at its own offset 0).
    rows = slice(0, len(DOC))
    for layer in range(CHECK_LAYER + 1, NUM_LAYERS):
        blended, ref = prefill.past_key_values.layers[layer], stored.layers[layer]
        assert torch.equal(blended.keys[:, :, rows], ref.keys)
        assert torch.equal(blended.values[:, :, rows], ref.values)
    assert daemon.pins_held() == 0


@pytest.mark.parametrize("how", ["engine.store", "store_segments"])
def test_the_seed_retriever_finds_a_document_whichever_api_stored_it(model, daemon, how):
    layout = layout_for_model(model, chunk_size=16, model_name=f"docs-retriever-{how}")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        stored = store(how, model, engine)
        retriever = SPTBlendRetriever(SPT, engine)
        with retriever.new_request(PROMPT, torch.tensor([0, len(PROMPT)])) as task:
            assert task.num_retrieved_tokens == len(DOC) > 0
            assert task.valid_mask.tolist() == [True] * len(DOC) + [False] * len(QUESTION)
            for layer in range(NUM_LAYERS):
                result = task.result(layer)  # the engine's format: [kv_heads, T, head_size]
                assert torch.equal(result.k[:, : len(DOC)], stored.layers[layer].keys[0])
                assert torch.equal(result.v[:, : len(DOC)], stored.layers[layer].values[0])
    assert daemon.pins_held() == 0


def test_a_segment_engine_finds_documents_stored_the_seed_way(model, daemon):
    """An engine of the segment namespace (vLLM's blend worker's kind) reads documents
    the seed API stored in the model's prefix namespace, token-major."""
    name = "docs-segment-engine"
    with CacheEngine.connect(layout_for_model(model, 16, name), socket=daemon.socket,
                             strict=True) as engine:
        stored = store("engine.store", model, engine)
    with CacheEngine.connect(segment_layout_for_model(model, 16, name), socket=daemon.socket,
                             strict=True) as segments:
        assert segments.lookup(DOC) == 0  # not in its own namespace
        with SPTBlendRetriever(SPT, segments).new_request(PROMPT, [0, len(PROMPT)]) as task:
            assert task.num_retrieved_tokens == len(DOC)
            result = task.result(2)  # [T, kv_heads, head_size]
            assert torch.equal(result.k[: len(DOC)], stored.layers[2].keys[0].transpose(0, 1))
            assert torch.equal(result.v[: len(DOC)], stored.layers[2].values[0].transpose(0, 1))
    assert daemon.pins_held() == 0


def test_an_engine_that_cannot_open_the_other_namespace_is_refused_with_the_fix(model, daemon):
    """Where a segment is missing from the engine's namespace and the engine cannot open
    a session on the other one (not made by CacheEngine.connect), new_request says so
    instead of missing silently, and leaves nothing pinned."""
    import time

    layout = layout_for_model(model, chunk_size=16, model_name="docs-no-sibling")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        # The document's first two chunks only: a partial hit, pinned, then the refusal.
        assert engine.store(DOC[:32], alone(model, DOC[:32])) == 2
        engine._connect_options = None  # as an engine built around a link by hand
        with pytest.raises(ValueError, match="needs an engine made by CacheEngine.connect"):
            SPTBlendRetriever(SPT, engine).new_request(PROMPT, [0, len(PROMPT)])
        deadline = time.monotonic() + 10.0  # RELEASE is not answered: poll
        while daemon.pins_held() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.pins_held() == 0
