"""The layer loop of CacheBlend inside vLLM (client/vllm/blend_layers.py), without vLLM.

A small torch model with the attributes of vLLM's Llama (`embed_input_ids`, fused
`qkv_proj` and `o_proj` returning `(out, bias)`, `rotary_emb(positions, q, k)`, RMSNorm
layer norms, `mlp`) stands in for vLLM's. Checked: with every row selected the loop
computes the model's causal forward; at ratio 0 a reused document's K/V at every layer
after the check layer are the document computed alone at its new offset.
"""

import pytest
import torch

from lmcached.client.blend.executor import CacheBlendImpl, LegoLinkImpl
from lmcached.client.blend.interfaces import BlendRetrieverResult, BlendRetrieverTask
from lmcached.client.blend.rope import LlamaRotary
from lmcached.client.vllm.blend_layers import check_blend_model, run_blended_layers

HIDDEN, HEADS, KV_HEADS, HEAD, LAYERS, VOCAB = 32, 4, 2, 8, 3, 50
ROTARY = LlamaRotary.from_params(HEAD, 10000.0)


class _Fused(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x), None


class _Rotary(torch.nn.Module):
    def forward(self, positions, q, k):
        return ROTARY.rotate(q, positions, 0), ROTARY.rotate(k, positions, 0)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD
        self.q_size, self.kv_size, self.scaling = HEADS * HEAD, KV_HEADS * HEAD, HEAD ** -0.5
        self.qkv_proj = _Fused(HIDDEN, self.q_size + 2 * self.kv_size)
        self.o_proj = _Fused(self.q_size, HIDDEN)
        self.rotary_emb = _Rotary()
        self.attn = torch.nn.Identity()  # vLLM's Attention: never called by the loop


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attention()
        self.input_layernorm = torch.nn.RMSNorm(HIDDEN)
        self.post_attention_layernorm = torch.nn.RMSNorm(HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, HIDDEN))


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))

    def embed_input_ids(self, ids):
        return self.embed_tokens(ids)


class FakeVllmLlama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = _Decoder()


def reference_kv(model, ids: torch.Tensor, first_position: int = 0) -> list[tuple]:
    """Per layer (K, V) `[T, kv_heads, head]` of a plain causal forward of `ids` placed at
    positions first_position, first_position + 1, ... (nothing before them)."""
    positions = torch.arange(first_position, first_position + ids.numel())
    hidden, out = model.model.embed_input_ids(ids), []
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(layer.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        q, k, v = (t.reshape(ids.numel(), -1, HEAD).transpose(0, 1) for t in (q, k, v))
        out.append((k.transpose(0, 1), v.transpose(0, 1)))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None],
                                                             is_causal=True)[0]
        o, _ = attn.o_proj(a.transpose(0, 1).reshape(ids.numel(), -1))
        hidden = hidden + o
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return out


class FakeTask(BlendRetrieverTask):
    """Retrieved K/V: `doc` (per layer K, V computed alone) placed at `offset`."""

    def __init__(self, num_tokens: int, doc=None, offset: int = 0):
        self.valid = torch.zeros(num_tokens, dtype=torch.bool)
        self.original = torch.zeros(num_tokens, dtype=torch.int64)
        self.doc, self.offset = doc, offset
        if doc is not None:
            n = doc[0][0].shape[0]
            self.valid[offset : offset + n] = True
            self.original[offset : offset + n] = torch.arange(n)

    def result(self, layer_id):
        if self.doc is None:
            return BlendRetrieverResult(None, None, self.valid, self.original)
        k = torch.zeros(self.valid.numel(), KV_HEADS, HEAD)
        v = torch.zeros_like(k)
        n = self.doc[layer_id][0].shape[0]
        k[self.offset : self.offset + n] = self.doc[layer_id][0]
        v[self.offset : self.offset + n] = self.doc[layer_id][1]
        return BlendRetrieverResult(k, v, self.valid, self.original)


def collect(model, ids, task, executor) -> list[tuple]:
    layers = []
    executor.set_positional_encoder(ROTARY.encoder)
    run_blended_layers(model, ids, task, executor,
                       lambda layer_id, k, v: layers.append((k.clone(), v.clone())))
    return layers


@torch.inference_mode()
def test_every_row_selected_computes_the_causal_forward():
    model = FakeVllmLlama()
    check_blend_model(model)
    ids = torch.randint(0, VOCAB, (20,))
    blended = collect(model, ids, FakeTask(20), CacheBlendImpl(1.0))
    for (k, v), (ref_k, ref_v) in zip(blended, reference_kv(model, ids)):
        torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("executor, first_reused_layer", [
    (CacheBlendImpl(0.0), 2),  # layers 0 and 1 (the check layer) are computed fresh
    (LegoLinkImpl(0), 0),
])
@torch.inference_mode()
def test_at_ratio_0_a_reused_document_is_the_document_alone_at_its_new_offset(
        executor, first_reused_layer):
    model = FakeVllmLlama()
    doc, prefix, question = (torch.randint(0, VOCAB, (n,)) for n in (12, 7, 5))
    stored = reference_kv(model, doc)  # computed alone from position 0
    ids = torch.cat((prefix, doc, question))
    blended = collect(model, ids, FakeTask(ids.numel(), stored, offset=7), executor)
    alone_at_offset = reference_kv(model, doc, first_position=7)
    rows = slice(7, 7 + doc.numel())
    for layer in range(first_reused_layer, LAYERS):
        torch.testing.assert_close(blended[layer][0][rows], alone_at_offset[layer][0],
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(blended[layer][1][rows], alone_at_offset[layer][1],
                                   rtol=1e-4, atol=1e-5)
    # The tokens without cached KV are the prompt's own, computed in context.
    full = reference_kv(model, ids)
    torch.testing.assert_close(blended[0][0][:7], full[0][0][:7], rtol=1e-5, atol=1e-5)


def test_a_model_with_qk_norms_is_refused():
    model = FakeVllmLlama()
    model.model.layers[1].self_attn.qk_norm = True
    with pytest.raises(ValueError, match="Q/K norms"):
        check_blend_model(model)
