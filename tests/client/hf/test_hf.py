"""generate_with_cache on a real (tiny, random-weight) Llama against a real daemon."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import CacheEngine  # noqa: E402
from lmcached.client.hf import generate_with_cache, layout_for_model  # noqa: E402

# fp32 prefill of a suffix over a cached prefix is not bit-identical to a full prefill
# (different matmul shapes); 1e-4 bounds the difference seen for this model size.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_layout_comes_from_the_model_config(model):
    layout = layout_for_model(model, chunk_size=16, model_name="tiny")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (2, 2, 16)
    assert layout.fmt == "huggingface" and layout.dtype == "float32"


def test_warm_runs_reuse_the_prefix_and_match_a_cold_run(model, daemon):
    prompt = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(1))
    reference = generate_with_cache(model, None, prompt, max_new_tokens=12)
    assert reference.num_cached_tokens == 0
    layout = layout_for_model(model, chunk_size=16, model_name="tiny")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        first = generate_with_cache(model, engine, prompt, max_new_tokens=12)
        assert first.num_cached_tokens == 0 and first.num_stored_chunks == 5
        again = generate_with_cache(model, engine, prompt, max_new_tokens=12)
        assert again.num_cached_tokens == 69  # all but the last token, which is computed
        sibling = torch.cat([prompt[:40], torch.arange(30)])  # shares chunks 0-1
        sibling_ref = generate_with_cache(model, None, sibling, max_new_tokens=12)
        sibling_warm = generate_with_cache(model, engine, sibling, max_new_tokens=12)
        assert sibling_warm.num_cached_tokens == 32
    for run, ref in ((first, reference), (again, reference), (sibling_warm, sibling_ref)):
        assert torch.equal(run.output_ids, ref.output_ids)
        assert torch.allclose(run.prefill_logits, ref.prefill_logits, atol=LOGITS_ATOL, rtol=0)


def test_refuses_models_it_cannot_cache(daemon):
    config = transformers.Qwen2Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
        sliding_window=8, max_window_layers=0,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="sliding_attention"):
        layout_for_model(model)


def test_refuses_an_engine_of_another_layout(model, daemon):
    layout = layout_for_model(model, chunk_size=16, model_name="tiny")
    other = layout.__class__(**{**layout.__dict__, "num_layers": 3})
    with CacheEngine.connect(other, socket=daemon.socket, strict=True) as engine:
        with pytest.raises(ValueError, match="does not match the model"):
            generate_with_cache(model, engine, torch.arange(20))
    with pytest.raises(ValueError, match="one non-empty prompt"):
        generate_with_cache(model, None, torch.zeros(2, 5, dtype=torch.int64))
