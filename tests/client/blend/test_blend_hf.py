"""store_segments / blend_prefill on tiny random-weight Llamas against a real daemon.

Exact paths are checked against a full prefill (`model(ids)`): every token recomputed
(ratio 1.0), a reused prefix (ratio 0, LegoLink), a fully cached prompt. A real blend is
checked by its counts (ceil(ratio x reused) + every token without cached KV) and by the
K/V it keeps: a reused segment's K/V on the layers after the check layer equal that
segment computed alone at its new offset (RoPE re-rotation end to end).
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import CacheEngine  # noqa: E402
from lmcached.client.hf import (  # noqa: E402
    CACHE_ARG,
    blend_prefill,
    generate_after_blend,
    generate_with_cache,
    layout_for_model,
    model_cache,
    segment_layout_for_model,
    store_segments,
)

# fp32 prefill of a subset of rows is not bit-identical to a full prefill (different
# matmul shapes); 1e-4 bounds the difference for these model sizes (as tests/client/hf/test_hf.py).
LOGITS_ATOL = 1e-4
VOCAB = 500
SPT = VOCAB - 1  # the separator: text tokens are drawn below it
NUM_LAYERS = 4  # CacheBlend checks at layer 1: layers 2-3 keep reused K/V
CHECK_LAYER = 1


def tiny_model(family: str = "llama", **overrides):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    if family == "mistral":
        overrides.setdefault("sliding_window", None)
    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
    torch.manual_seed(0)
    return model_class(config_class(**{**params, **overrides})).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def connect(model, daemon, name="tiny-blend"):
    return CacheEngine.connect(layout_for_model(model, chunk_size=16, model_name=name),
                               socket=daemon.socket, strict=True)


def text(num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SPT, (num_tokens,), generator=torch.Generator().manual_seed(seed))


def doc(num_tokens: int, seed: int) -> torch.Tensor:
    """A document segment: text, then the separator."""
    return torch.cat([text(num_tokens - 1, seed), torch.tensor([SPT])])


DOCS = (doc(37, 1), doc(23, 2), doc(41, 3))  # lengths not multiples of the chunk size
QUESTION = text(9, 4)


@torch.inference_mode()
def full_prefill(model, ids, position_ids=None):
    out = model(ids[None], position_ids=position_ids, use_cache=True)
    return out.logits[0, -1].float(), model_cache(out)


def assert_cache_close(cache, reference, atol=LOGITS_ATOL):
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer, ref in zip(cache.layers, reference.layers, strict=True):
        assert torch.allclose(layer.keys, ref.keys, atol=atol, rtol=0)
        assert torch.allclose(layer.values, ref.values, atol=atol, rtol=0)


def test_store_segments_stores_each_segment_from_position_zero_once(model, daemon):
    with connect(model, daemon) as engine:
        prompt = torch.cat([*DOCS, QUESTION])
        assert store_segments(model, engine, prompt, SPT) == len(prompt)
        assert store_segments(model, engine, prompt, SPT) == 0
        # Each its own chain, from position 0, in the segment namespace (token-major,
        # shared with vLLM), not in the engine's own (prefix caching, head-major).
        segments = engine.sibling(segment_layout_for_model(model, 16, "tiny-blend"))
        assert segments.layout.fmt == "vllm" and segments.layout.model_name == "tiny-blend|blend-segments"
        assert engine.sibling(segments.layout) is segments and engine.sibling(engine.layout) is engine
        for segment in (*DOCS, QUESTION):
            assert segments.lookup(segment) == len(segment)
            assert engine.lookup(segment) == 0
        kv, mask = segments.retrieve(DOCS[1])
        assert int(mask.sum()) == len(DOCS[1])
        _, alone = full_prefill(model, DOCS[1])
        for (keys, values), ref in zip(kv, alone.layers, strict=True):
            # [T, kv_heads, head_size]: the head-major cache's rows, bit for bit
            assert torch.equal(keys, ref.keys[0].transpose(0, 1))
            assert torch.equal(values, ref.values[0].transpose(0, 1))
        # Only the new segment of a prompt is computed.
        new_doc = doc(19, 5)
        assert store_segments(model, engine, torch.cat([DOCS[0], new_doc]), SPT) == len(new_doc)
    assert segments.link.hello_reply is None and segments.link.arena is None  # closed with engine


def test_documents_are_shared_through_the_segment_namespace_under_their_salt(model, daemon):
    """An engine of layout_for_model and one of segment_layout_for_model (another
    process, e.g. vLLM's blend worker) see the same documents, only under their salt."""
    prompt = torch.cat([*DOCS, QUESTION])
    logits, _ = full_prefill(model, prompt)
    layout = segment_layout_for_model(model, chunk_size=16, model_name="tiny-shared")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        assert store_segments(model, engine, torch.cat(DOCS), SPT, cache_salt="a") == 101
    with connect(model, daemon, name="tiny-shared") as engine:
        assert store_segments(model, engine, torch.cat(DOCS), SPT, cache_salt="a") == 0
        reused = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0, cache_salt="a")
        unsalted = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0)
    assert reused.num_reused_tokens == len(torch.cat(DOCS))
    assert unsalted.num_reused_tokens == 0
    assert torch.allclose(reused.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert daemon.pins_held() == 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_ratio_one_equals_full_prefill(family, daemon):
    model = tiny_model(family)
    prompt = torch.cat([*DOCS, QUESTION])
    with connect(model, daemon, name=f"tiny-{family}") as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0)
    logits, cache = full_prefill(model, prompt)
    assert prefill.num_reused_tokens == sum(map(len, DOCS))
    assert prefill.num_recomputed_tokens == len(prompt)
    assert prefill.logits.dtype == torch.float32 and prefill.logits.shape == (VOCAB,)
    assert torch.allclose(prefill.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert_cache_close(prefill.past_key_values, cache)


@pytest.mark.parametrize("strategy", ["cacheblend", "legolink"])
def test_reused_prefix_gives_full_prefill_at_ratio_zero(model, daemon, strategy):
    prompt = torch.cat([DOCS[0], QUESTION])
    with connect(model, daemon) as engine:
        store_segments(model, engine, DOCS[0], SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0,
                                strategy=strategy, legolink_k=4)
    logits, cache = full_prefill(model, prompt)
    assert prefill.num_reused_tokens == len(DOCS[0])
    assert prefill.num_recomputed_tokens == len(QUESTION)  # the first segment keeps its KV
    assert torch.allclose(prefill.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert_cache_close(prefill.past_key_values, cache)


def test_fully_cached_prompt_still_computes_its_last_token(model, daemon):
    prompt = torch.cat(DOCS[:2])
    with connect(model, daemon) as engine:
        store_segments(model, engine, prompt, SPT)
        prefix_only = blend_prefill(model, engine, DOCS[0], SPT, recompute_ratio=0.0)
        blended = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
    assert prefix_only.num_reused_tokens == len(DOCS[0]) - 1
    assert prefix_only.num_recomputed_tokens == 1
    assert torch.allclose(prefix_only.logits, full_prefill(model, DOCS[0])[0],
                          atol=LOGITS_ATOL, rtol=0)
    assert blended.num_recomputed_tokens == 1
    assert torch.isfinite(blended.logits).all()


def test_blend_recomputes_ceil_ratio_of_reused_tokens(model, daemon):
    prompt = torch.cat([*DOCS, QUESTION])
    num_reused = sum(map(len, DOCS))
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        runs = {ratio: blend_prefill(model, engine, prompt, SPT, recompute_ratio=ratio)
                for ratio in (0.0, 0.15, 1.0)}
        legolink = blend_prefill(model, engine, prompt, SPT, strategy="legolink",
                                 legolink_k=4)
    logits, _ = full_prefill(model, prompt)
    for ratio, run in runs.items():
        assert run.num_reused_tokens == num_reused
        assert run.num_recomputed_tokens == math.ceil(ratio * num_reused) + len(QUESTION)
        assert run.past_key_values.get_seq_length() == len(prompt)
        assert torch.isfinite(run.logits).all()
    # Only the first segment is a prefix: blending the others loses cross-attention, so
    # ratio 0 and 0.15 are approximations, within the scale of the logits themselves.
    error = {ratio: float((run.logits - logits).abs().max()) for ratio, run in runs.items()}
    assert error[1.0] <= LOGITS_ATOL < error[0.0]
    assert error[0.15] < float(logits.abs().max())
    # LegoLink: the first 4 tokens of every reused segment but the first, and the question.
    assert legolink.num_reused_tokens == num_reused
    assert legolink.num_recomputed_tokens == 4 + 4 + len(QUESTION)


def test_blend_keeps_reused_kv_moved_to_its_new_offset(model, daemon):
    """After the check layer an unselected token keeps its segment's cached K/V, its K
    rotated to the new position: equal to the segment computed alone at its offset."""
    prompt = torch.cat([*DOCS, QUESTION])
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
    offset = 0
    for segment in DOCS:
        positions = torch.arange(offset, offset + len(segment))[None]
        _, shifted = full_prefill(model, segment, position_ids=positions)
        for layer in range(CHECK_LAYER + 1, NUM_LAYERS):
            blended = prefill.past_key_values.layers[layer]
            rows = slice(offset, offset + len(segment))
            assert torch.allclose(blended.keys[:, :, rows], shifted.layers[layer].keys,
                                  atol=LOGITS_ATOL, rtol=0)
            assert torch.allclose(blended.values[:, :, rows], shifted.layers[layer].values,
                                  atol=LOGITS_ATOL, rtol=0)
        offset += len(segment)


def test_greedy_after_blend_at_ratio_one_equals_plain_greedy(model, daemon):
    prompt = torch.cat([*DOCS, QUESTION])
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0)
    reference = generate_with_cache(model, None, prompt, max_new_tokens=10).output_ids
    assert torch.equal(generate_after_blend(model, prefill, max_new_tokens=10), reference)
    assert torch.equal(generate_after_blend(model, prefill, max_new_tokens=10), reference)
    # model.generate continues from the cache given the prompt and the first token.
    prefill.past_key_values.crop(-(prefill.past_key_values.get_seq_length() - len(prompt)))
    first = reference[:1]
    with torch.inference_mode():
        out = model.generate(torch.cat([prompt, first])[None], do_sample=False,
                             **{CACHE_ARG: prefill.past_key_values},
                             max_new_tokens=9, min_new_tokens=9)
    assert torch.equal(out[0, len(prompt):], reference)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_scaling_is_exact_at_ratio_one_and_yarn_is_refused(daemon):
    model = tiny_model(rope_scaling=LLAMA3_SCALING, rope_theta=10000.0)
    prompt = torch.cat([*DOCS, QUESTION])
    with connect(model, daemon, name="tiny-llama3") as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0)
    logits, cache = full_prefill(model, prompt)
    assert torch.allclose(prefill.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert_cache_close(prefill.past_key_values, cache)

    yarn = tiny_model(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 128})
    with connect(yarn, daemon, name="tiny-yarn") as engine:
        with pytest.raises(ValueError, match="yarn"):
            blend_prefill(yarn, engine, prompt, SPT)


def test_refuses_misuse(model, daemon):
    prompt = torch.cat([DOCS[0], QUESTION])
    with connect(model, daemon) as engine:
        with pytest.raises(ValueError, match="1-D prompt"):
            blend_prefill(model, engine, prompt[None], SPT)
        with pytest.raises(ValueError, match="1-D prompt"):
            store_segments(model, engine, prompt[None], SPT)
        with pytest.raises(ValueError, match="strategy"):
            blend_prefill(model, engine, prompt, SPT, strategy="epic")
    other = tiny_model(num_hidden_layers=2)
    with connect(other, daemon) as engine:
        with pytest.raises(ValueError, match="does not match the model"):
            blend_prefill(model, engine, prompt, SPT)
    with CacheEngine.connect(segment_layout_for_model(other, 16), socket=daemon.socket,
                             strict=True) as engine:
        with pytest.raises(ValueError, match="does not match the model"):
            store_segments(model, engine, prompt, SPT)
    qwen3 = tiny_model("qwen3", head_dim=16)  # q_norm / k_norm: not reproduced
    with connect(qwen3, daemon, name="tiny-qwen3") as engine:
        with pytest.raises(ValueError, match="qwen3"):
            blend_prefill(qwen3, engine, prompt, SPT)


def test_documents_under_another_name_or_chunk_size_are_misses(model, daemon):
    prompt = torch.cat([DOCS[0], QUESTION])
    with connect(model, daemon, name="tiny-a") as engine:
        assert store_segments(model, engine, DOCS[0], SPT) == len(DOCS[0])
    for name, chunk_size in (("tiny-a", 16), ("tiny-b", 16), ("tiny-a", 32)):
        layout = segment_layout_for_model(model, chunk_size, model_name=name)
        with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
            same = (name, chunk_size) == ("tiny-a", 16)
            assert engine.lookup(DOCS[0]) == (len(DOCS[0]) if same else 0)
            prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
            assert prefill.num_reused_tokens == (len(DOCS[0]) if same else 0)
    assert daemon.pins_held() == 0


def test_prompt_without_separator_is_one_segment(model, daemon):
    prompt = text(40, 6)
    with connect(model, daemon) as engine:
        nothing = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
        assert store_segments(model, engine, prompt, SPT) == len(prompt)
        cached = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
    logits, _ = full_prefill(model, prompt)
    assert (nothing.num_reused_tokens, nothing.num_recomputed_tokens) == (0, len(prompt))
    assert (cached.num_reused_tokens, cached.num_recomputed_tokens) == (len(prompt) - 1, 1)
    for run in (nothing, cached):
        assert torch.allclose(run.logits, logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ratio_one_equals_full_prefill_on_cuda(daemon):
    model = tiny_model().cuda()
    prompt = torch.cat([*DOCS, QUESTION]).cuda()
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS).cuda(), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=1.0)
        blended = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.15)
    logits, cache = full_prefill(model, prompt)
    assert prefill.logits.device == logits.device
    assert torch.allclose(prefill.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert_cache_close(prefill.past_key_values, cache)
    assert torch.isfinite(blended.logits).all()


@pytest.mark.parametrize("losses", [1, 2])
def test_pins_lost_mid_prefill_retry_once_then_prefill_in_full(model, daemon, monkeypatch,
                                                                losses):
    # The task's daemon session ends between two layers (PinsLost): blend_prefill pins
    # again once; if that is lost too, it reuses nothing. Either way the prefill is right.
    from lmcached.client.blend.retriever import SPTBlendRetrieverTask
    from lmcached.client.views import PinsLost

    prompt = torch.cat([DOCS[0], QUESTION])
    result = SPTBlendRetrieverTask.result
    calls = {"lost": 0}

    def result_losing_pins(task, layer_id):
        if layer_id == 2 and task._runs and calls["lost"] < losses:
            calls["lost"] += 1
            raise PinsLost("test: the session ended")
        return result(task, layer_id)

    monkeypatch.setattr(SPTBlendRetrieverTask, "result", result_losing_pins)
    with connect(model, daemon) as engine:
        store_segments(model, engine, DOCS[0], SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.0)
        assert engine.link.hello_reply is not None
    logits, cache = full_prefill(model, prompt)
    assert calls["lost"] == losses
    assert prefill.num_reused_tokens == (len(DOCS[0]) if losses == 1 else 0)
    assert prefill.num_recomputed_tokens == (len(QUESTION) if losses == 1 else len(prompt))
    assert torch.allclose(prefill.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert_cache_close(prefill.past_key_values, cache)
    assert daemon.pins_held() == 0


@pytest.mark.parametrize("kwargs", [dict(recompute_ratio=0.15), dict(recompute_ratio=0.5),
                                    dict(strategy="legolink", legolink_k=4)])
def test_blend_without_a_dense_mask_equals_the_masked_attention(model, daemon, monkeypatch,
                                                                kwargs):
    """blend_prefill's attention (attend_at_positions) against SDPA with the dense mask
    it replaced: same logits and K/V, with the selected rows scattered over the prompt."""
    import torch.nn.functional as F

    from lmcached.client import hf_blend

    def masked(query, key, value, positions, scale=None, plan=None):
        groups = query.shape[1] // key.shape[1]
        mask = torch.arange(key.shape[2])[None, :] <= positions[:, None]
        return F.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
            attn_mask=mask[None, None], scale=scale)

    prompt = torch.cat([DOCS[1], DOCS[0], DOCS[2], QUESTION])  # no segment at its offset
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        fast = blend_prefill(model, engine, prompt, SPT, **kwargs)
        monkeypatch.setattr(hf_blend, "attend_at_positions", masked)
        reference = blend_prefill(model, engine, prompt, SPT, **kwargs)
    rows = fast.num_recomputed_tokens
    assert rows == reference.num_recomputed_tokens and rows < len(prompt)
    assert torch.allclose(fast.logits, reference.logits, atol=1e-5, rtol=0)
    assert_cache_close(fast.past_key_values, reference.past_key_values, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(recompute_ratio=0.15),
                                    dict(strategy="legolink", legolink_k=4)])
def test_blend_computes_only_the_rows_it_reads(model, daemon, kwargs):
    """The last layer's K/V are computed for every selected row (the cache holds them),
    its MLP only for the prompt's last token (the logits read nothing else); LegoLink's
    layer 0 and CacheBlend's check layer project Q only for the rows they select."""
    mlp_rows = {}

    def count(layer_id):
        def hook(module, args):
            mlp_rows[layer_id] = args[0].shape[0]
        return hook

    handles = [layer.mlp.register_forward_pre_hook(count(i))
               for i, layer in enumerate(model.model.layers)]
    for layer in (0, 1):
        handles.append(model.model.layers[layer].self_attn.q_proj.register_forward_pre_hook(
            count(f"q_proj {layer}")))
    prompt = torch.cat([DOCS[1], DOCS[0], DOCS[2], QUESTION])
    try:
        with connect(model, daemon) as engine:
            store_segments(model, engine, torch.cat(DOCS), SPT)
            mlp_rows.clear()
            prefill = blend_prefill(model, engine, prompt, SPT, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert mlp_rows[NUM_LAYERS - 1] == 1
    assert mlp_rows[NUM_LAYERS - 2] == prefill.num_recomputed_tokens > 1
    # LegoLink's selection is known before layer 0: only its rows are projected there.
    assert mlp_rows["q_proj 0"] == (prefill.num_recomputed_tokens
                                    if kwargs.get("strategy") == "legolink" else len(prompt))
    # CacheBlend's check layer (1) projects Q after its selection, for the selected rows.
    assert mlp_rows["q_proj 1"] == prefill.num_recomputed_tokens
    assert prefill.past_key_values.get_seq_length() == len(prompt)
    assert daemon.pins_held() == 0


def test_layers_after_the_selection_reuse_its_positions_plan(model, daemon, monkeypatch):
    """One PositionsPlan per selection, not per layer: every row at layer 0, the
    selection at layers 1 and 2 (one plan), the last token at the last layer."""
    from lmcached.client import hf_blend

    plans = []
    real = hf_blend.PositionsPlan

    def counting(positions, *args):
        plans.append(positions.numel())
        return real(positions, *args)

    monkeypatch.setattr(hf_blend, "PositionsPlan", counting)
    prompt = torch.cat([DOCS[1], DOCS[0], DOCS[2], QUESTION])
    with connect(model, daemon) as engine:
        store_segments(model, engine, torch.cat(DOCS), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT, recompute_ratio=0.15)
    assert plans == [len(prompt), prefill.num_recomputed_tokens, 1]
