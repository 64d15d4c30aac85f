"""One vLLM (CPU) instance for the end-to-end tests and figures of the lmcached connector.

Runs in its own process (vLLM's multiprocessing mode spawns, hence the __main__ guard)::

    python tests/vllm_e2e.py build-model DIR [--layers 2] [--dtype bfloat16]
    python tests/vllm_e2e.py run --model DIR --prompts P.json --out R.json \\
        [--socket S --chunk-size 256] [--max-tokens 8] [--mode outputs|ttft] [--batch N] \\
        [--blend-model] [--logprobs N] [--dtype bfloat16] [--cache-salt SALT] \\
        [--no-prefix-caching] [--max-num-batched-tokens N --max-num-seqs N] \\
        [--fail-once HOOK]

A prompt is a list of token ids, or a dict {"prompt_token_ids": [...], "cache_salt": str,
"kv_transfer_params": {...}} (CacheBlend requests: docs/cacheblend.md).

Modes (the result JSON always has "startup_s" and "mode"):
    outputs: generate() over the prompts, --batch at a time (default: all at once);
             "outputs" (greedy token ids) and "num_cached_tokens" per prompt (vLLM's
             local + external prefix hits), "generate_s" and "num_steps" (engine
             steps) per call, and with --time-hooks "connector_s": time spent inside
             the connector's hooks per call. With --logprobs N, "logprobs": the first
             generated token's top-N logprobs ({token id: logprob}) per prompt. With
             the connector, "blend": the connector's CacheBlend counters (refusals by
             reason, claimed requests, blended requests, ...) as vLLM's connector stats
             carried them to its stats logger; "connector_stats": every count of the
             connector's stats summed (their data layout, client/vllm/connector_stats.py);
             "prometheus": what vLLM's Prometheus registry holds of the connector's
             counters (`LLM.get_metrics()`, `vllm:lmcached_*`: [name, labels, value]);
             "block_size": vLLM's. With --fail-once HOOK (in-process mode), the
             scheduler side's HOOK raises at its first call.
    ttft:    one generate(max_tokens=1) per prompt, in turn: "ttft_s" per prompt (the
             wall time of a one-token generate, i.e. the prefill) and "num_cached_tokens".
Set VLLM_CPU_KVCACHE_SPACE and VLLM_ENABLE_V1_MULTIPROCESSING in the environment.
"""

import argparse
import json
import os
import sys
import time


def build_model(path: str, num_layers: int = 2, dtype: str = "bfloat16",
                hidden_size: int = 128) -> None:
    """A random-weight Llama (hidden 128: 4 heads of 32, CPU attention needs >= 32;
    larger: heads of 64), saved without a tokenizer; seeded, so every build is the same
    model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=max(4, hidden_size // 64),
        num_key_value_heads=max(2, hidden_size // 128), max_position_embeddings=16384,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype=dtype,
    )
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)


HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_save",
         "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta")


def time_connector_hooks() -> dict:
    """Wrap the connector's hooks with timers (in-process mode: both roles live here)."""
    from lmcached.client.vllm import connector as vllm_connector

    spent = {"s": 0.0}
    for name in HOOKS:
        inner = getattr(vllm_connector.LMCachedConnector, name)

        def timed(self, *args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0

        setattr(vllm_connector.LMCachedConnector, name, timed)
    return spent


BLEND_COUNTERS = ("claimed_requests", "store_only_requests", "blended_requests",
                  "reused_tokens", "recomputed_tokens", "stored_segments", "skipped_stores",
                  "dropped_stores", "failed_blends")


def observe_connector_stats() -> dict:
    """Sum what vLLM's stats logger receives of the connector's stats
    (`KVConnectorLogging.observe`, each step: the scheduler's and the workers'
    `get_kv_connector_stats`, carried in `SchedulerStats`), rebuilt with the connector's
    own `build_kv_connector_stats` as vLLM rebuilds them: {"stats": the sum or None}."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from lmcached.client.vllm.connector import LMCachedConnector

    seen = {"stats": None}
    inner = KVConnectorLogging.observe

    def observe(self, data):
        stats = LMCachedConnector.build_kv_connector_stats(data)
        seen["stats"] = stats if seen["stats"] is None else seen["stats"].aggregate(stats)
        return inner(self, data)

    KVConnectorLogging.observe = observe
    return seen


def fail_once(hook: str) -> None:
    """Make the connector's scheduler side raise at its first call of `hook` (e.g.
    "update_state_after_alloc"), as a bug would (in-process mode: the scheduler lives
    here)."""
    from lmcached.client.vllm.scheduler import LMCachedConnectorScheduler

    inner, calls = getattr(LMCachedConnectorScheduler, hook), {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OverflowError(f"{hook} failed on purpose (tests/vllm_e2e.py --fail-once)")
        return inner(self, *args, **kwargs)

    setattr(LMCachedConnectorScheduler, hook, failing)


def connector_metrics(llm) -> list:
    """The connector's counters in vLLM's Prometheus registry, as vLLM reads it
    (`LLM.get_metrics()`): [name, labels, value] per sample of `vllm:lmcached_*`."""
    return [[m.name, dict(m.labels), m.value] for m in llm.get_metrics()
            if m.name.startswith("vllm:lmcached_")]


def blend_counters(seen: dict) -> dict:
    """The connector's CacheBlend counters as vLLM's connector stats reported them
    (`observe_connector_stats`)."""
    data = seen["stats"].data if seen["stats"] is not None else {}
    return {"refusals": dict(data.get("refusals", {})),
            **{name: data.get(name, 0) for name in BLEND_COUNTERS}}


def run(args) -> dict:
    from vllm import LLM, SamplingParams

    hook_time = time_connector_hooks() if args.time_hooks else None
    connector_stats = observe_connector_stats() if args.socket else None
    if args.fail_once:
        fail_once(args.fail_once)

    with open(args.prompts) as f:
        prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in json.load(f)]
    transfer_params = [p.pop("kv_transfer_params", None) for p in prompts]
    if args.cache_salt:  # a tenant: vLLM folds it into its block hashes, lmcached into its chain
        for prompt in prompts:
            prompt.setdefault("cache_salt", args.cache_salt)
    kwargs = {}
    if args.socket:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMCachedConnector",
            "kv_connector_module_path": "lmcached.client.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket": args.socket, "chunk_size": args.chunk_size},
        }
        kwargs["disable_log_stats"] = False  # vLLM then carries the connector's stats
    if args.blend_model:
        kwargs["hf_overrides"] = {"architectures": ["LMCachedLlamaForCausalLM"]}
    if args.logprobs:
        kwargs["max_logprobs"] = args.logprobs
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.max_num_batched_tokens:  # vLLM requires max_num_seqs <= this
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        kwargs["max_num_seqs"] = args.max_num_seqs
    start = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
              max_model_len=args.max_model_len, seed=0,
              tensor_parallel_size=args.tensor_parallel_size, **kwargs)
    result = {"mode": args.mode, "connector": bool(args.socket),
              "startup_s": round(time.perf_counter() - start, 3)}
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                             detokenize=False, logprobs=args.logprobs or None,
                             extra_args={"kv_transfer_params": t} if t else None)
              for t in transfer_params]
    if args.mode == "ttft":
        one = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                              extra_args={"kv_transfer_params": t} if t else None)
               for t in transfer_params]
        warm_up = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                 detokenize=False)
        llm.generate([{"prompt_token_ids": [5] * 8}], warm_up, use_tqdm=False)
        ttft, cached = [], []
        for prompt, params_one in zip(prompts, one):
            t0 = time.perf_counter()
            (out,) = llm.generate([prompt], params_one, use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
            cached.append(out.num_cached_tokens)
        result.update(ttft_s=ttft, num_cached_tokens=cached)
        if args.socket:
            result["blend"] = blend_counters(connector_stats)
    else:
        engine, steps = llm.llm_engine, {"n": 0}
        inner_step = engine.step

        def counting_step():
            steps["n"] += 1
            return inner_step()

        engine.step = counting_step
        batch = args.batch or len(prompts)
        result.update(generate_s=[], num_steps=[], outputs=[], num_cached_tokens=[],
                      connector_s=[], logprobs=[])
        for first in range(0, len(prompts), batch):
            steps["n"] = 0
            if hook_time is not None:
                hook_time["s"] = 0.0
            t0 = time.perf_counter()
            outs = llm.generate(prompts[first : first + batch], params[first : first + batch],
                                use_tqdm=False)
            result["generate_s"].append(time.perf_counter() - t0)
            if hook_time is not None:
                result["connector_s"].append(hook_time["s"])
            result["num_steps"].append(steps["n"])
            result["outputs"] += [list(o.outputs[0].token_ids) for o in outs]
            result["num_cached_tokens"] += [o.num_cached_tokens for o in outs]
            if args.logprobs:
                result["logprobs"] += [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}
                                       for o in outs]
        if args.socket:
            result["blend"] = blend_counters(connector_stats)
    if args.socket:
        result["connector_stats"] = (connector_stats["stats"].data
                                     if connector_stats["stats"] is not None else {})
        result["prometheus"] = connector_metrics(llm)
        result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    del llm
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model")
    build.add_argument("path")
    build.add_argument("--layers", type=int, default=2)
    build.add_argument("--dtype", default="bfloat16")
    build.add_argument("--hidden", type=int, default=128)
    gen = sub.add_parser("run")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    gen.add_argument("--out", required=True)
    gen.add_argument("--socket", help="lmcached socket: enables the connector")
    gen.add_argument("--chunk-size", type=int, default=256)
    gen.add_argument("--max-tokens", type=int, default=8)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="TP workers (needs the default multiprocessing mode)")
    gen.add_argument("--mode", choices=("outputs", "ttft"), default="outputs")
    gen.add_argument("--time-hooks", action="store_true",
                     help="time the connector's hooks (in-process mode only)")
    gen.add_argument("--batch", type=int, default=0,
                     help="prompts per generate() call (default: all in one)")
    gen.add_argument("--blend-model", action="store_true",
                     help="select LMCachedLlamaForCausalLM (CacheBlend inside vLLM)")
    gen.add_argument("--logprobs", type=int, default=0,
                     help="report the first token's top-N logprobs")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--cache-salt", help="every prompt's cache_salt (a tenant)")
    gen.add_argument("--max-num-batched-tokens", type=int, default=0,
                     help="vLLM's token budget per step (default: vLLM's)")
    gen.add_argument("--max-num-seqs", type=int, default=8,
                     help="requests per step, with --max-num-batched-tokens")
    gen.add_argument("--no-prefix-caching", action="store_true",
                     help="turn vLLM's own prefix cache off (each request computed or "
                     "blended from scratch, never from another request's blocks)")
    gen.add_argument("--fail-once", metavar="HOOK",
                     help="the connector's scheduler side raises at its first call of HOOK "
                     "(in-process mode only)")
    args = parser.parse_args()
    if args.command == "build-model":
        build_model(args.path, args.layers, args.dtype, args.hidden)
        return 0
    result = run(args)
    result["pid"] = os.getpid()
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
