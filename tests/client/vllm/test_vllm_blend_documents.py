"""vLLM's blend worker finds documents wherever the model's documents may live.

A document stored LMCache's way (`engine.store(segment, kv)` from position 0 on a
Hugging Face engine of the same model name and geometry) is blended by the worker (its
engine is of the segment namespace), with the stored bytes written into the paged
slots; and it is not computed and stored a second time. Without vLLM: the stand-in model
and paged attention of test_vllm_blend_worker.py.
"""

import numpy as np
import torch

from lmcached.client import CacheEngine
from lmcached.client.blend.segments import prefix_layout_of, segment_layout_of

from test_vllm_blend_layers import reference_kv
from test_vllm_blend_worker import LAYOUT, SEP, make_worker, paged_model, slots, spec_of


def test_the_worker_blends_a_document_stored_the_seed_way(daemon):
    rng = np.random.default_rng(21)
    doc = rng.integers(0, SEP, 14).tolist() + [SEP]
    question = rng.integers(0, SEP, 6).tolist()
    model = paged_model()
    alone = reference_kv(model, torch.tensor(doc))  # per layer (K, V) [T, kv_heads, head]
    # [num_layers, 2, kv_heads, T, head]: the Hugging Face format of the seed API.
    kv = torch.stack([torch.stack((k.transpose(0, 1), v.transpose(0, 1))) for k, v in alone])
    segments = segment_layout_of(LAYOUT)  # the worker's namespace, as blend_config makes it
    prefix_layout = prefix_layout_of(segments)
    assert prefix_layout.fmt == "huggingface" and prefix_layout.model_name == "blend-worker-test"
    with CacheEngine.connect(prefix_layout, socket=daemon.socket, strict=True) as engine:
        assert engine.store(torch.tensor(doc), kv.detach(), cache_salt="s") == 2

    worker = make_worker(daemon.socket, segments)
    spec = spec_of(doc + question, ratio=0.0)
    worker.run([spec], model)
    assert worker.num_blended_requests == 1 and worker.num_failed_blends == 0
    assert worker.num_reused_tokens == len(doc) > 0
    assert worker.num_stored_segments == 1  # the question only: the document was found
    rows = slots(spec, range(len(doc)))
    for layer_id in range(2, len(alone)):  # after the check layer: the stored bytes
        cache = model.model.layers[layer_id].self_attn.attn.kv_cache
        assert torch.equal(cache[rows, 0], alone[layer_id][0])
        assert torch.equal(cache[rows, 1], alone[layer_id][1])
    assert daemon.pins_held() == 0
    worker.shutdown()
