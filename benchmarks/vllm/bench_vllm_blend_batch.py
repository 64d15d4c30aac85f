"""The cost of a blend to the rest of the batch: decode step times of other requests while a
4k-token RAG request arrives, inside vLLM on CPU.

    .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm_blend_batch --out-dir /tmp/lmc-batch \\
        [--size 4096] [--decoders 4] [--max-num-batched-tokens 2048] [--repeats 2]

Why: vLLM's chunked prefill splits a long prompt over steps of at most
`max_num_batched_tokens` tokens, so the requests decoding beside it wait at most one chunk
per step. CacheBlend inside vLLM runs in the connector's `start_load_kv`, before the forward
of one step (client/vllm/blend_worker.py), outside vLLM's token budget (only
`blend_tokens_per_step` bounds it), and so does the first meeting of a document set,
which computes every document alone and stores it. This script measures what each costs
the other requests.

Starts its own daemon, builds the random-weight Llama of bench_vllm_blend.py (float32,
8 layers, hidden 512 by default: speed, not quality), and runs one vLLM instance in-process
(this file's `engine` command) with the connector and `LMCachedLlamaForCausalLM`, stepping
the engine itself (`LLMEngine.add_request` + `step()`, vLLM's V1 engine in-process, so a
step's wall time is its scheduling, the connector's hooks and the forward). In each
scenario `--decoders` plain requests (32-token prompts, greedy, no EOS) decode; after
`--warm-steps` steps one more request arrives (none, in the baseline):

    none         nothing arrives: decode steps alone
    full         a plain RAG prompt of --size tokens (vLLM's chunked prefill)
    store        the first blend request that meets its documents: served normally
                 (chunked), and its worker computes every document alone and stores it
                 in the step the request is first scheduled
    cb 0.15      CacheBlend 0.15 over those stored documents, in another order
    legolink 16  LegoLink 16, likewise

Per scenario: the plain requests' inter-token latency (ITL: the time between two of their
tokens, i.e. one step) over the steps before the arrival (median) and from the arrival to
the arriving request's first token (max and sum, the number of steps), the time the
blend worker took inside the step (`blend_s`), and the arriving request's TTFT. Prints a
table and writes OUT_DIR/batch-figures.json (every step of every scenario).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks import module_env
from benchmarks.vllm.bench_vllm_blend import SEP, rag_parts, random_model

from lmcached.launcher import temporary_daemon

SCENARIOS = ("none", "full", "store", "cb 0.15", "legolink 16")
BLEND = {"cb 0.15": {"recompute_ratio": 0.15},
         "legolink 16": {"strategy": "legolink", "legolink_k": 16}}


def arrivals(rng, size: int, repeats: int) -> list[tuple[str, dict | None]]:
    """(scenario, arriving request or None) in run order; the documents are met first by
    each repeat's "store" request, under a salt of its own, then reused in new orders."""
    system, docs, question = rag_parts(rng, size)
    out = []
    for repeat in range(repeats):
        salt = f"docs-{size}-{repeat}"  # each repeat meets its documents anew
        for name in SCENARIOS:
            if name == "none":
                out.append((name, None))
                continue
            order = rng.permutation(len(docs)).tolist() if name != "store" else range(len(docs))
            body = sum((docs[i] for i in order), []) + question
            if name == "full":
                out.append((name, {"prompt_token_ids": system + body,
                                   "cache_salt": f"full-{size}-{repeat}"}))
                continue
            # A marker segment of its own keeps vLLM's prefix cache from serving this
            # request another blend's blocks (as bench_vllm_blend.py).
            marker = [3 + len(out), SEP]
            blend = {"separator": SEP, **BLEND.get(name, {})}
            out.append((name, {"prompt_token_ids": system + marker + body, "cache_salt": salt,
                               "kv_transfer_params": {"lmcached_blend": blend}}))
    return out


def run_engine(args) -> dict:
    """The `engine` command: one vLLM instance, every scenario in turn, stepped here."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from lmcached.client.vllm import blend_worker

    blend_time = {"s": 0.0}
    inner_run = blend_worker.BlendWorker.run

    def timed_run(self, specs, model):
        t0 = time.perf_counter()
        try:
            return inner_run(self, specs, model)
        finally:
            blend_time["s"] += time.perf_counter() - t0

    blend_worker.BlendWorker.run = timed_run
    with open(args.plan) as f:
        plan = json.load(f)
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=args.max_model_len, seed=0,
              max_num_batched_tokens=args.max_num_batched_tokens,
              hf_overrides={"architectures": ["LMCachedLlamaForCausalLM"]},
              kv_transfer_config={
                  "kv_connector": "LMCachedConnector",
                  "kv_connector_module_path": "lmcached.client.vllm_connector",
                  "kv_role": "kv_both",
                  "kv_connector_extra_config": {"socket": args.socket}})
    engine = llm.llm_engine
    rng = np.random.default_rng(1)
    llm.generate([{"prompt_token_ids": [5] * 8}], SamplingParams(max_tokens=2), use_tqdm=False)
    # DELTA: every step returns each request's new tokens (LLM.generate asks FINAL_ONLY)
    decode = SamplingParams(temperature=0.0, max_tokens=plan["decode_tokens"], ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)
    runs = []
    for index, (name, arriving) in enumerate(plan["arrivals"]):
        decoders = [f"{index}-d{i}" for i in range(plan["decoders"])]
        for req_id in decoders:
            prompt = rng.integers(3, SEP, 32).tolist()
            engine.add_request(req_id, {"prompt_token_ids": prompt}, decode)
        steps, step_no = [], 0
        while engine.has_unfinished_requests():
            if step_no == plan["warm_steps"] and arriving is not None:
                transfer = arriving.pop("kv_transfer_params", None)
                engine.add_request(f"{index}-x", arriving, SamplingParams(
                    temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                    extra_args={"kv_transfer_params": transfer} if transfer else None))
                arrived = time.perf_counter()
            blend_time["s"] = 0.0
            t0 = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            got = [out.request_id for out in outs if out.outputs[0].token_ids]
            steps.append({"start": t0, "end": t1, "blend_s": blend_time["s"],
                          "decoded": sum(r in decoders for r in got),
                          "arrived_first_token": f"{index}-x" in got})
            step_no += 1
        run = {"scenario": name, "steps": steps}
        if arriving is not None:
            first = next(s for s in steps if s["arrived_first_token"])
            run["ttft_s"] = first["end"] - arrived
        runs.append(run)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().blend_worker
    counters = {"blended_requests": worker.num_blended_requests,
                "stored_segments": worker.num_stored_segments,
                "failed_blends": worker.num_failed_blends}
    return {"runs": runs, "blend": counters}


def summarize(run: dict, warm_steps: int) -> dict:
    """ITL of the plain requests before the arrival and while the arriving request waits for
    its first token (the steps from its arrival to that token, both included)."""
    steps = run["steps"]
    itl = []  # (step index, the time since the previous step that decoded)
    last_end = None
    for i, step in enumerate(steps):
        if step["decoded"] and last_end is not None:
            itl.append((i, step["end"] - last_end))
        if step["decoded"]:
            last_end = step["end"]
    end = next((i for i, s in enumerate(steps) if s["arrived_first_token"]), None)
    if end is None:  # nothing arrived: the same window of steps as the others
        end = warm_steps + 2
    before = [t for i, t in itl if 1 < i < warm_steps]
    during = [t for i, t in itl if warm_steps <= i <= end]
    return {"itl_before_median_ms": 1000 * statistics.median(before),
            "itl_during_max_ms": 1000 * max(during),
            "itl_during_sum_ms": 1000 * sum(during), "steps_during": len(during),
            "blend_ms": 1000 * sum(s["blend_s"] for s in steps[warm_steps:end + 1]),
            "ttft_ms": 1000 * run["ttft_s"] if "ttft_s" in run else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    eng = sub.add_parser("engine", help="(internal) the vLLM process")
    for name in ("--model", "--plan", "--out", "--socket"):
        eng.add_argument(name, required=True)
    eng.add_argument("--max-model-len", type=int, required=True)
    eng.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--out-dir")
    parser.add_argument("--size", type=int, default=4096, help="tokens of the arriving prompt")
    parser.add_argument("--decoders", type=int, default=4, help="plain requests decoding")
    parser.add_argument("--warm-steps", type=int, default=6,
                        help="decode steps before the request arrives")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="vLLM's token budget per step (2048: the OpenAI server's default "
                        "on CPU; the LLM class's is 4096)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.command == "engine":
        with open(args.out, "w") as f:
            json.dump(run_engine(args), f)
        return 0
    if not args.out_dir:
        parser.error("--out-dir is required")
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    model = random_model(out, args.layers, args.hidden)
    plan = {"arrivals": arrivals(np.random.default_rng(0), args.size, args.repeats),
            "decoders": args.decoders, "warm_steps": args.warm_steps,
            "decode_tokens": args.warm_steps + 24}
    plan_path, result_path = os.path.join(out, "batch.in.json"), os.path.join(out, "batch.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    with temporary_daemon("--capacity", "1GiB", name=f"bench-vllm-batch-{os.getpid()}") as socket:
        cmd = [sys.executable, "-m", "benchmarks.vllm.bench_vllm_blend_batch", "engine",
               "--model", model, "--plan", plan_path, "--out", result_path, "--socket", socket,
               "--max-model-len", str(args.size + 1024),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        env = module_env(dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2",
                              VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        with open(os.path.join(out, "batch.log"), "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                           timeout=1200)
    with open(result_path) as f:
        result = json.load(f)
    rows: dict[str, list[dict]] = {}
    for run in result["runs"]:
        rows.setdefault(run["scenario"], []).append(summarize(run, args.warm_steps))
    print(f"{args.decoders} plain requests decoding, then a {args.size}-token request arrives; "
          f"max_num_batched_tokens {args.max_num_batched_tokens}; {args.layers} layers, hidden "
          f"{args.hidden}, float32, CPU; median over {args.repeats} repeats (ms)")
    keys = ("itl_before_median_ms", "itl_during_max_ms", "itl_during_sum_ms", "steps_during",
            "blend_ms", "ttft_ms")
    print("scenario".ljust(13) + "".join(k.removesuffix("_ms").rjust(22) for k in keys))
    figures = {}
    for name in SCENARIOS:
        med = {k: (statistics.median(r[k] for r in rows[name])
                   if rows[name][0][k] is not None else None) for k in keys}
        figures[name] = {"median": med, "runs": rows[name]}
        print(name.ljust(13) + "".join(("-" if med[k] is None else f"{med[k]:.0f}").rjust(22)
                                       for k in keys))
    print("blend counters:", result["blend"])
    with open(os.path.join(out, "batch-figures.json"), "w") as f:
        json.dump({"args": vars(args), "blend": result["blend"], "scenarios": figures,
                   "steps": result["runs"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
