"""GPU paths: store from CUDA tensors, retrieve into CUDA buffers (run on a GPU machine).

Skipped without CUDA. On a GPU machine: `pytest -m cuda` or `pytest tests/client/cuda/test_cuda.py`.
"""

import pytest
import torch

from lmcached.client import CacheEngine, KVLayout

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_layout(fmt="vllm") -> KVLayout:
    return KVLayout("gpu-llama", num_layers=4, num_kv_heads=4, head_size=64,
                    dtype="bfloat16", chunk_size=64, fmt=fmt)


@pytest.mark.parametrize("cuda_register", [False, True], ids=["pageable", "registered"])
def test_store_from_gpu_and_retrieve_into_gpu_bit_exactly(daemon, cuda_register):
    layout = make_layout()
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True,
                             cuda_register=cuda_register) as engine:
        kv = torch.randn(layout.chunk_shape(300), device="cuda").to(torch.bfloat16)
        assert engine.store(torch.arange(300), kv) == 5
        out = torch.empty(layout.chunk_shape(512), dtype=torch.bfloat16, device="cuda")
        got, ret_mask = engine.retrieve(torch.arange(300), return_tuple=False, out=out)
        assert got.device.type == "cuda" and got.data_ptr() == out.data_ptr()
        assert bool(ret_mask.all()) and torch.equal(got, kv)
        host, _ = engine.retrieve(torch.arange(300), return_tuple=False)
        assert host.device.type == "cpu" and torch.equal(host, kv.cpu())


def test_tuple_of_gpu_layers_and_views_copied_to_gpu(daemon):
    layout = make_layout()
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True, cuda_register=True) as engine:
        blob = torch.randn(layout.chunk_shape(128), device="cuda").to(torch.bfloat16)
        layers = tuple((blob[i, 0].clone(), blob[i, 1].clone()) for i in range(4))
        assert engine.store(torch.arange(128), layers) == 2
        out = tuple((torch.empty(128, 4, 64, dtype=torch.bfloat16, device="cuda"),
                     torch.empty(128, 4, 64, dtype=torch.bfloat16, device="cuda")) for _ in range(4))
        got, _ = engine.retrieve(torch.arange(128), out=out)
        assert all(torch.equal(k, blob[i, 0]) and torch.equal(v, blob[i, 1])
                   for i, (k, v) in enumerate(got))
        dst = torch.zeros(layout.chunk_shape(128), dtype=torch.bfloat16, device="cuda")
        with engine.retrieve_views(torch.arange(128)) as views:
            assert torch.equal(views.copy_to(dst), blob)


def test_hf_generation_on_gpu_matches_a_cold_run(daemon):
    transformers = pytest.importorskip("transformers")
    from lmcached.client.hf import generate_with_cache, layout_for_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    prompt = torch.randint(0, 500, (100,), device="cuda")
    reference = generate_with_cache(model, None, prompt, max_new_tokens=8)
    layout = layout_for_model(model, chunk_size=32, model_name="gpu-tiny")
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True, cuda_register=True) as engine:
        generate_with_cache(model, engine, prompt, max_new_tokens=8)
        warm = generate_with_cache(model, engine, prompt, max_new_tokens=8)
    assert warm.num_cached_tokens == 99
    assert torch.equal(warm.output_ids, reference.output_ids)
    assert torch.allclose(warm.prefill_logits, reference.prefill_logits, atol=1e-3, rtol=0)
