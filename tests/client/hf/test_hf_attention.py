"""The "lmcached_sdpa" attention of a transformers model over a cached prefix, against
transformers' own sdpa (explicit mask), and greedy generation with and without the cache."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import CacheEngine  # noqa: E402
from lmcached.client import hf_attention  # noqa: E402
from lmcached.client.hf import CACHE_ARG, generate_with_cache, layout_for_model, model_cache  # noqa: E402
from lmcached.client.hf_attention import LMCACHED_ATTENTION, prefix_attention  # noqa: E402

CHUNK = 16
NUM_TOKENS = 70
# Same weights, same rows: only the attention kernel differs (fp32: < 1e-6 seen).
ATOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def tiny_llama(dtype=torch.float32, attn_implementation="sdpa"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation=attn_implementation,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts the calls of the fast path (attend_causal_suffix) made by the model."""
    calls = []
    real = hf_attention.attend_causal_suffix

    def spy(query, key, value, scale=None):
        calls.append((query.shape[2], key.shape[2]))
        return real(query, key, value, scale=scale)

    monkeypatch.setattr(hf_attention, "attend_causal_suffix", spy)
    return calls


def prompt(seed=1):
    return torch.randint(0, 500, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def suffix_logits(model, ids, num_cached, fast: bool):
    """Logits of ids[num_cached:] over the cropped KV of a full forward of the prompt."""
    cache = model_cache(model(ids, use_cache=True))
    cache.crop(num_cached - ids.shape[1])  # transformers 5: a negative count removes that many
    if fast:
        with prefix_attention(model):
            return model(ids[:, num_cached:], **{CACHE_ARG: cache}).logits.float()
    return model(ids[:, num_cached:], **{CACHE_ARG: cache}).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_cached", [1, CHUNK - 1, NUM_TOKENS // 2, NUM_TOKENS - 2])
def test_prefix_attention_equals_sdpa_with_its_mask(num_cached, dtype, fast_calls):
    model = tiny_llama(dtype)
    ids = prompt()
    expected = suffix_logits(model, ids, num_cached, fast=False)
    assert not fast_calls
    got = suffix_logits(model, ids, num_cached, fast=True)
    # Every layer took the fast path, with the cached keys in front of the queries.
    assert fast_calls == [(NUM_TOKENS - num_cached, NUM_TOKENS)] * 2
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)


def test_padding_and_other_implementations_keep_transformers_path(model, fast_calls):
    ids = prompt()
    padding = torch.ones_like(ids)
    padding[0, :3] = 0  # left padding: the mask is needed, sdpa's path computes it
    with torch.inference_mode():
        expected = model(ids, attention_mask=padding).logits
        with prefix_attention(model):
            assert model.config._attn_implementation == LMCACHED_ATTENTION
            got = model(ids, attention_mask=padding).logits
    assert not fast_calls
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    eager = tiny_llama(attn_implementation="eager")
    with prefix_attention(eager):
        assert eager.config._attn_implementation == "eager"  # the caller's choice is kept


@pytest.mark.parametrize("num_stored", [0, CHUNK, 2 * CHUNK, NUM_TOKENS])
def test_greedy_with_a_cached_prefix_equals_no_cache(model, daemon, fast_calls, num_stored):
    ids = prompt(seed=2)[0]
    reference = generate_with_cache(model, None, ids, max_new_tokens=12)
    layout = layout_for_model(model, chunk_size=CHUNK, model_name="tiny-prefix-attention")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        if num_stored:
            generate_with_cache(model, engine, ids[:num_stored], max_new_tokens=1)
        fast_calls.clear()
        warm = generate_with_cache(model, engine, ids, max_new_tokens=12, store=False,
                                   min_cached_tokens=0)
    # The whole prompt stored: all but its last token reused (that one gives the logits).
    assert warm.num_cached_tokens == min(num_stored, NUM_TOKENS - 1)
    if 0 < warm.num_cached_tokens < NUM_TOKENS - 1:
        assert fast_calls  # the prefill over the cached prefix took the fast path
    assert torch.equal(warm.output_ids, reference.output_ids)
    torch.testing.assert_close(warm.prefill_logits, reference.prefill_logits, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ the hit decision
@pytest.fixture
def retrieves(monkeypatch):
    """Counts CacheEngine.retrieve calls (the loading a short hit must not pay)."""
    calls = []
    real = CacheEngine.retrieve

    def spy(self, *args, **kwargs):
        calls.append(args[0].numel())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CacheEngine, "retrieve", spy)
    return calls


def test_a_hit_shorter_than_min_cached_tokens_is_not_loaded(model, daemon, retrieves):
    ids = prompt(seed=3)[0]
    reference = generate_with_cache(model, None, ids, max_new_tokens=6)
    layout = layout_for_model(model, chunk_size=CHUNK, model_name="tiny-hit-decision")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        generate_with_cache(model, engine, ids[:2 * CHUNK], max_new_tokens=1)  # 2 chunks
        retrieves.clear()
        # Above the chunk size: one LOOKUP decides, the 32-token hit is too short.
        skipped = generate_with_cache(model, engine, ids, max_new_tokens=6, store=False,
                                      min_cached_tokens=2 * CHUNK + 1)
        assert skipped.num_cached_tokens == 0 and retrieves == []
        used = generate_with_cache(model, engine, ids, max_new_tokens=6, store=False,
                                   min_cached_tokens=2 * CHUNK)
        assert used.num_cached_tokens == 2 * CHUNK and retrieves == [NUM_TOKENS]
        # A prompt too short to reach the threshold is computed without asking the daemon.
        short = ids[:10]
        generate_with_cache(model, engine, short, max_new_tokens=1)  # stored whole
        retrieves.clear()
        cold = generate_with_cache(model, engine, short, max_new_tokens=1, min_cached_tokens=10)
        assert cold.num_cached_tokens == 0 and retrieves == []
        warm = generate_with_cache(model, engine, short, max_new_tokens=1, min_cached_tokens=0)
        assert warm.num_cached_tokens == 9 and retrieves == [10]
        with pytest.raises(ValueError, match="min_cached_tokens must be >= 0"):
            generate_with_cache(model, engine, short, min_cached_tokens=-1)
    for run in (skipped, used):
        assert torch.equal(run.output_ids, reference.output_ids)
