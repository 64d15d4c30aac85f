"""The one CacheBlend layer loop (client/blend/layer_loop.py) through both of its adapters.

A tiny random-weight transformers Llama runs through the Hugging Face adapter
(client/hf_blend.py); a stand-in with vLLM's module interface (fused `qkv_proj` and
`o_proj` returning `(out, bias)`, `rotary_emb(positions, q, k)`, `embed_input_ids`)
built from the same weights runs through the vLLM adapter (client/vllm/blend_layers.py),
which vllm need not be installed for. Both get the same prompt and the same retrieved
documents: LegoLink's layer-0 selection and CacheBlend's check-layer selection must pick
the same rows, the long K/V of every layer must agree, and both paths must compute only
the selected rows where the selection is known before they are computed.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import hf_blend  # noqa: E402
from lmcached.client.blend.executor import CacheBlendImpl, LegoLinkImpl  # noqa: E402
from lmcached.client.blend.interfaces import (  # noqa: E402
    BlendRetrieverResult,
    BlendRetrieverTask,
)
from lmcached.client.blend.rope import LlamaRotary  # noqa: E402
from lmcached.client.vllm import blend_layers  # noqa: E402

VOCAB, LAYERS, HEADS, KV_HEADS, HIDDEN = 300, 4, 4, 2, 64
HEAD = HIDDEN // HEADS


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


class _Fused(torch.nn.Module):
    """A vLLM linear layer: returns (out, bias)."""

    def __init__(self, *weights):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat([w.detach() for w in weights]))
        self.rows = []  # rows of each call

    def forward(self, x):
        self.rows.append(x.shape[0])
        return torch.nn.functional.linear(x, self.weight), None


class _Rotary(torch.nn.Module):
    """vLLM's rotary embedding: (positions, q, k) with heads flattened."""

    def __init__(self, rotary: LlamaRotary):
        super().__init__()
        self.rotary = rotary

    def forward(self, positions, q, k):
        return self.rotary.rotate(q, positions, 0), self.rotary.rotate(k, positions, 0)


class _Attention(torch.nn.Module):
    def __init__(self, hf_attn, rotary):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD
        self.q_size, self.kv_size, self.scaling = HEADS * HEAD, KV_HEADS * HEAD, HEAD ** -0.5
        self.qkv_proj = _Fused(hf_attn.q_proj.weight, hf_attn.k_proj.weight,
                               hf_attn.v_proj.weight)
        self.o_proj = _Fused(hf_attn.o_proj.weight)
        self.rotary_emb = _Rotary(rotary)
        self.attn = torch.nn.Identity()  # vLLM's Attention: never called by the loop


class _Layer(torch.nn.Module):
    def __init__(self, hf_layer, rotary):
        super().__init__()
        self.self_attn = _Attention(hf_layer.self_attn, rotary)
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.mlp = hf_layer.mlp


class _Decoder(torch.nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        rotary = LlamaRotary.from_model(hf_model)
        self.embed_tokens = hf_model.model.embed_tokens
        self.layers = torch.nn.ModuleList(_Layer(layer, rotary)
                                          for layer in hf_model.model.layers)

    def embed_input_ids(self, ids):
        return self.embed_tokens(ids)


class VllmStandIn(torch.nn.Module):
    """vLLM's LlamaForCausalLM as the loop sees it, with the weights of `hf_model`."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = _Decoder(hf_model)


@torch.inference_mode()
def alone(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) `[n, kv_heads, head_size]` of `ids` computed alone from position 0."""
    out = model(ids[None], use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache")
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
            for layer in cache.layers]


class DocumentsTask(BlendRetrieverTask):
    """Retrieved K/V: documents computed alone, at their offsets in the prompt."""

    def __init__(self, num_tokens: int, documents: list[tuple[int, list]]):
        self.valid = torch.zeros(num_tokens, dtype=torch.bool)
        self.original = torch.zeros(num_tokens, dtype=torch.int64)
        self.documents = documents
        for offset, kv in documents:
            n = kv[0][0].shape[0]
            self.valid[offset : offset + n] = True
            self.original[offset : offset + n] = torch.arange(n)

    def result(self, layer_id):
        k = torch.zeros(self.valid.numel(), KV_HEADS, HEAD)
        v = torch.zeros_like(k)
        for offset, kv in self.documents:
            n = kv[layer_id][0].shape[0]
            k[offset : offset + n] = kv[layer_id][0]
            v[offset : offset + n] = kv[layer_id][1]
        return BlendRetrieverResult(k, v, self.valid, self.original)


@pytest.fixture(scope="module")
def models():
    hf = tiny_llama()
    return hf, VllmStandIn(hf)


def prompt_and_task(hf):
    gen = torch.Generator().manual_seed(1)
    system, doc1, doc2, question = (torch.randint(0, VOCAB, (n,), generator=gen)
                                    for n in (11, 23, 17, 7))
    ids = torch.cat((system, doc1, doc2, question))
    documents = [(0, alone(hf, system)), (11, alone(hf, doc1)), (34, alone(hf, doc2))]
    return ids, DocumentsTask(ids.numel(), documents)


def executor_of(kind, hf):
    executor = CacheBlendImpl(0.15) if kind == "cacheblend" else LegoLinkImpl(4)
    executor.set_positional_encoder(LlamaRotary.from_model(hf).encoder)
    return executor


@pytest.mark.parametrize("kind", ["cacheblend", "legolink"])
@torch.inference_mode()
def test_both_adapters_select_the_same_rows_and_blend_the_same_kv(models, kind):
    hf, vllm_like = models
    ids, task = prompt_and_task(hf)
    hf_run = hf_blend.run_blended_layers(hf, ids, task, executor_of(kind, hf))
    for layer in vllm_like.model.layers:
        layer.self_attn.qkv_proj.rows.clear()
    vllm_kv = []
    vllm_run = blend_layers.run_blended_layers(
        vllm_like, ids, task, executor_of(kind, hf),
        lambda layer_id, k, v: vllm_kv.append((k.clone(), v.clone())))

    num_reused = 11 + 23 + 17
    expected = (list(range(11, 15)) + list(range(34, 38)) if kind == "legolink" else None)
    assert hf_run.num_reused_tokens == vllm_run.num_reused_tokens == num_reused
    assert torch.equal(hf_run.recomputed_indices, vllm_run.recomputed_indices)
    selected = hf_run.recomputed_indices.tolist()
    question = list(range(num_reused, ids.numel()))
    if expected is not None:  # LegoLink: the first 4 tokens of every non-first document
        assert selected == expected + question
    else:  # CacheBlend: ceil(0.15 * 51) = 8 reused tokens plus the question
        assert len(selected) == 8 + len(question) and selected[-len(question):] == question
    # The long K/V each layer attended over agree (re-rotation, fresh rows).
    for (k, v), hf_layer in zip(vllm_kv, hf_run.cache.layers, strict=True):
        torch.testing.assert_close(k, hf_layer.keys[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, hf_layer.values[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
    # Where the selection is known before layer 0 (LegoLink), the vLLM path too projects
    # only the selected rows there; CacheBlend projects every row up to its check layer.
    layer0_rows = vllm_like.model.layers[0].self_attn.qkv_proj.rows
    assert layer0_rows == [len(selected) if kind == "legolink" else ids.numel()]
