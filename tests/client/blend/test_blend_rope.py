"""LlamaRotary: re-rotating a cached K by a position delta equals computing it there."""

import functools

import pytest
import torch

from lmcached.client.blend.rope import LlamaRotary

transformers = pytest.importorskip("transformers")

from lmcached.client.hf import model_cache  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# The model's fp32 K at position p uses fp32 angles p * inv_freq, whose rounding grows
# with p; for |K| < 1 it stays far inside 1e-3 at p = 4000.
K_ATOL = 1e-3


def tiny_llama(rope_theta=10000.0, rope_scaling=None, **extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        rope_theta=rope_theta, rope_scaling=rope_scaling, **extra)
    return transformers.LlamaForCausalLM(config).eval()


@functools.cache
def cached_llama(kind):
    """The tiny Llama of rope `kind` ("default" or "llama3"), built once per session."""
    if kind == "llama3":
        return tiny_llama(500000.0, LLAMA3_SCALING)
    return tiny_llama(10000.0)


def layer0_k(model, ids, positions):
    """[kv_heads, n, head_dim] layer-0 K of `ids` computed at `positions` (int64 [n])."""
    with torch.no_grad():
        out = model(ids[None], position_ids=positions[None], use_cache=True)
    return model_cache(out).layers[0].keys[0]


@pytest.mark.parametrize("kind", ["default", "llama3"])
@pytest.mark.parametrize("offset", [1, 300, 517, 4000])
def test_rerotated_layer0_k_equals_k_computed_at_the_offset(kind, offset):
    model = cached_llama(kind)
    rope = LlamaRotary.from_model(model)
    ids = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(offset))
    stored = layer0_k(model, ids, torch.arange(24))
    expected = layer0_k(model, ids, torch.arange(offset, offset + 24))
    moved = rope.rotate(stored, torch.full((24,), offset), token_dim=1)
    assert (expected - stored).abs().max() > 10 * K_ATOL  # the offset matters
    assert torch.allclose(moved, expected, atol=K_ATOL, rtol=0)
    # Per-token deltas: every token moved by its own amount (segments at other offsets).
    deltas = torch.randint(0, offset + 1, (24,), generator=torch.Generator().manual_seed(9))
    expected = layer0_k(model, ids, torch.arange(24) + deltas)
    assert torch.allclose(rope.rotate(stored, deltas, 1), expected, atol=K_ATOL, rtol=0)


def test_llama3_model_uses_the_scaled_frequencies_from_params_computes():
    model = cached_llama("llama3")
    from_model = LlamaRotary.from_model(model)
    from_params = LlamaRotary.from_params(16, 500000.0, LLAMA3_SCALING)
    default = LlamaRotary.from_params(16, 500000.0)
    assert torch.allclose(from_model.inv_freq, from_params.inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(from_model.inv_freq, default.inv_freq, rtol=1e-3, atol=0)
    plain = LlamaRotary.from_model(cached_llama("default"))
    assert torch.equal(plain.inv_freq, LlamaRotary.from_params(16, 10000.0).inv_freq)
    assert plain.head_dim == 16


def test_rotation_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = cached_llama("llama3")
    rope = LlamaRotary.from_model(model)
    x = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 3, 9, 40, 41, 100, 250, 999, 1000, 2047]])
    cos, sin = model.model.rotary_emb(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.allclose(rope.rotate(x, positions[0], token_dim=2), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scaling,extra,match", [
    ({"rope_type": "yarn", "factor": 4.0}, {}, "yarn"),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "dynamic"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
      "original_max_position_embeddings": 64}, {}, "longrope"),
    (None, {"partial_rotary_factor": 0.5}, "partial"),
])
def test_refuses_rope_it_cannot_move_by_a_delta(scaling, extra, match):
    model = tiny_llama(10000.0, scaling, **extra)
    with pytest.raises(ValueError, match=match):
        LlamaRotary.from_model(model)


def test_refuses_attention_scaling_other_than_one():
    model = tiny_llama()
    model.model.rotary_emb.attention_scaling = 1.2
    with pytest.raises(ValueError, match="attention_scaling"):
        LlamaRotary.from_model(model)


def test_from_params_refuses_unknown_types_and_missing_keys():
    with pytest.raises(ValueError, match="yarn"):
        LlamaRotary.from_params(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        LlamaRotary.from_params(16, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="even"):
        LlamaRotary.from_params(15, 10000.0)
    linear = LlamaRotary.from_params(16, 10000.0, {"type": "linear", "factor": 2.0})
    assert torch.allclose(linear.inv_freq * 2, LlamaRotary.from_params(16, 10000.0).inv_freq)


def test_rotate_by_zero_is_identity_and_by_minus_d_undoes_d():
    rope = LlamaRotary.from_params(16, 500000.0, LLAMA3_SCALING)
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rope.rotate(x, torch.zeros(7, dtype=torch.long), token_dim=0), x)
    delta = torch.tensor([1, -5, 300, 4000, 0, 77, 12345])
    there = rope.rotate(x, delta, token_dim=0)
    assert (there - x).abs().max() > 0.1
    assert torch.allclose(rope.rotate(there, -delta, token_dim=0), x, atol=1e-5, rtol=0)


def test_encoders_are_token_first_inverse_and_keep_dtype():
    rope = LlamaRotary.from_params(8, 10000.0)
    k = torch.randn(5, 2 * 8, generator=torch.Generator().manual_seed(2))  # heads flattened
    positions = torch.tensor([0, 10, 20, 30, 40])
    q, rotated = rope.encoder(positions, None, k)
    assert q is None
    assert torch.allclose(rotated.view(5, 2, 8), rope.rotate(k.view(5, 2, 8), positions, 0))
    _, back = rope.reverse_encoder(positions, None, rotated)
    assert torch.allclose(back, k, atol=1e-5, rtol=0)
    q16, k16 = rope.encoder(positions, k.bfloat16(), k.bfloat16())
    assert q16.dtype == k16.dtype == torch.bfloat16
    assert torch.allclose(k16.float(), rotated, atol=0.05, rtol=0)


def test_rotate_rejects_bad_arguments():
    rope = LlamaRotary.from_params(8, 10000.0)
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="entries"):
        rope.rotate(x, torch.zeros(3), token_dim=1)
    with pytest.raises(ValueError, match="other than the last"):
        rope.rotate(x, torch.zeros(8), token_dim=-1)
    with pytest.raises(ValueError, match="multiple"):
        rope.rotate(torch.randn(2, 4, 12), torch.zeros(4), token_dim=1)
    with pytest.raises(TypeError, match="floating-point"):
        LlamaRotary(torch.arange(4))


def test_tokens_sharing_a_delta_rotate_as_if_each_were_alone():
    # rotate() computes the angles once per distinct delta (segments move as a block).
    rope = LlamaRotary.from_params(8, 10000.0)
    x = torch.randn(2, 7, 3, 8)
    deltas = torch.tensor([5, 5, 0, 900, 5, -3, 900])
    rotated = rope.rotate(x, deltas, token_dim=1)
    for token, delta in enumerate(deltas.tolist()):
        alone = rope.rotate(x[:, token : token + 1], torch.tensor([delta]), token_dim=1)
        assert torch.equal(rotated[:, token : token + 1], alone)


def test_the_tables_of_one_delta_tensor_are_made_once(monkeypatch):
    """A blend executor passes one delta tensor to every layer of a batch: its cos/sin
    are computed once; a tensor modified in place or another tensor gets new tables."""
    rope = LlamaRotary.from_params(16, 10000.0)
    calls = []
    real = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: calls.append(1) or real(*a, **k))
    delta = torch.tensor([0, 0, 5, 5, 9])
    x = torch.randn(5, 2, 16)
    first = rope.rotate(x, delta, 0)
    assert torch.equal(rope.rotate(x, delta, 0), first) and len(calls) == 1
    delta[2:] += 1  # modified in place: new tables
    moved = rope.rotate(x, delta, 0)
    assert len(calls) == 2 and not torch.equal(moved, first)
    assert torch.equal(rope.rotate(x, delta.clone(), 0), moved) and len(calls) == 3


@pytest.mark.parametrize("kind", ["default", "llama3"])
def test_the_config_reader_gives_the_rope_the_model_uses(kind):
    """One reader of the RoPE settings (`rope_settings`) serves the Hugging Face path
    (from the model) and vLLM's blend worker (from the config): both get the same
    rotation, and both refuse what a delta rotation cannot move."""
    from lmcached.client.vllm.blend_worker import rotary_of

    model = cached_llama(kind)
    from_model = LlamaRotary.from_model(model)
    for from_config in (LlamaRotary.from_config(model.config), rotary_of(model.config)):
        assert from_config.head_dim == from_model.head_dim
        assert torch.allclose(from_config.inv_freq, from_model.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("extra,match", [
    ({"partial_rotary_factor": 0.5}, "partial"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_the_config_reader_refuses_what_from_model_refuses(extra, match):
    from lmcached.client.vllm.blend_worker import rotary_of

    model = tiny_llama(**extra)
    for read in (LlamaRotary.from_model, lambda m: rotary_of(m.config)):
        with pytest.raises(ValueError, match=match):
            read(model)
