"""A Hugging Face process that stores and blends CacheBlend documents, for the tests that
share documents with vLLM (tests/client/vllm/test_vllm_blend.py).

Runs in its own process, on the model directory a vLLM instance loads::

    python tests/hf_blend_process.py store --model DIR --socket S --prompts P.json \\
        --out R.json --separator ID --cache-salt SALT [--chunk-size 256]
    python tests/hf_blend_process.py blend ... [--ratio 1.0] [--documents D.json]

The engine is the one of `layout_for_model(model, chunk_size, model_name=DIR)` (DIR: the
name vLLM's connector uses by default), so the documents go through its segment sibling.

store: `store_segments` of each prompt; "num_computed": tokens computed per prompt.
blend: per prompt, `blend_prefill` at --ratio and a full prefill of the same model:
    "num_reused", "max_logit_diff" (max |blend - full| of the next-token logits),
    "argmax_equal". With --documents (a JSON list of segments), "max_kv_diff": per
    segment, the max |cached - computed alone| over every layer's K and V, its cached
    KV read from the segment namespace (None where not fully cached).
"""

import argparse
import json
import sys

import torch
from transformers import LlamaForCausalLM

from lmcached.client import CacheEngine
from lmcached.client.hf import (
    blend_prefill,
    layout_for_model,
    model_cache,
    segment_layout_for_model,
    store_segments,
)


@torch.inference_mode()
def _max_kv_diff(model, segments_engine: CacheEngine, tokens: list[int], salt: str):
    """max |cached - computed alone| over every layer's K and V of one segment, or None."""
    ids = torch.tensor(tokens)
    kv, mask = segments_engine.retrieve(ids, cache_salt=salt)
    if int(mask.sum()) != len(tokens):
        return None
    alone = model_cache(model(ids[None], use_cache=True))
    diffs = [float((cached - fresh[0].transpose(0, 1)).abs().max())
             for (k, v), layer in zip(kv, alone.layers, strict=True)
             for cached, fresh in ((k, layer.keys), (v, layer.values))]
    return max(diffs)


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("store", "blend"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--separator", type=int, required=True)
    parser.add_argument("--cache-salt", required=True)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--ratio", type=float, default=1.0)
    parser.add_argument("--documents")
    args = parser.parse_args()

    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with open(args.prompts) as f:
        prompts = json.load(f)
    layout = layout_for_model(model, args.chunk_size, model_name=args.model)
    result: dict = {}
    with CacheEngine.connect(layout, socket=args.socket, strict=True,
                             data_timeout_s=5.0) as engine:
        if args.command == "store":
            result["num_computed"] = [
                store_segments(model, engine, torch.tensor(p), args.separator,
                               cache_salt=args.cache_salt) for p in prompts]
        else:
            result.update(num_reused=[], max_logit_diff=[], argmax_equal=[])
            for prompt in prompts:
                ids = torch.tensor(prompt)
                blend = blend_prefill(model, engine, ids, args.separator,
                                      recompute_ratio=args.ratio, cache_salt=args.cache_salt)
                full = model(ids[None]).logits[0, -1].float()
                result["num_reused"].append(blend.num_reused_tokens)
                result["max_logit_diff"].append(float((blend.logits - full).abs().max()))
                result["argmax_equal"].append(int(blend.logits.argmax()) == int(full.argmax()))
            if args.documents:
                with open(args.documents) as f:
                    documents = json.load(f)
                segments = engine.sibling(segment_layout_for_model(model, args.chunk_size,
                                                                   args.model))
                result["max_kv_diff"] = [_max_kv_diff(model, segments, d, args.cache_salt)
                                         for d in documents]
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
