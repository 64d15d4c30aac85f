"""CacheBlend inside vLLM on CPU: TTFT of RAG prompts per method, in one vLLM process.

    .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm_blend --out-dir /tmp/lmc-blend \\
        [--sizes 2048 4096] [--layers 8] [--hidden 512] [--repeats 2]

Starts its own daemon (stopped at the end), builds a random-weight Llama (float32; the
weights are random, so these are speed figures, not quality), and runs one vLLM
instance of tests/vllm_e2e.py in TTFT mode (one generate(max_tokens=1) per prompt, in
turn, in-process) with the connector and `LMCachedLlamaForCausalLM`. Per size, a RAG
prompt is a system prompt (100 tokens), documents of 512-1024 tokens and a 20-token
question, joined by a separator; the documents are first met (and stored alone, under
the size's cache salt: documents are keyed under the request's salt) by one request,
whose stores two short requests finish (the worker spreads them over steps), then every
measured request puts them in another order. The full prefill and the prefix
cache run under salts of their own; a blend request runs under the size's salt with a
one-token segment of its own after the system prompt, so that vLLM's prefix cache never
serves one method from another's blended blocks (at most the system prompt's):

    full         a plain request: vLLM computes the whole prompt
    prefix       vLLM's own prefix cache holding the system prompt (what prefix
                 caching can reuse in such a prompt)
    cb R         CacheBlend, recompute ratio R (0.05, 0.15, 0.3)
    legolink K   LegoLink, K tokens per document (1, 4, 16)

Prints a table of median TTFT and speed-up against the full prefill measured in the same
run, and writes OUT_DIR/blend-figures.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

from benchmarks import REPO
from lmcached.launcher import temporary_daemon

E2E = os.path.join(REPO, "tests", "vllm_e2e.py")
SEP = 999
METHODS = [("full", None), ("prefix", None)] + [
    (f"cb {r}", {"recompute_ratio": r}) for r in (0.05, 0.15, 0.3)] + [
    (f"legolink {k}", {"strategy": "legolink", "legolink_k": k}) for k in (1, 4, 16)]


def rag_parts(rng, size: int) -> tuple[list[int], list[list[int]], list[int]]:
    """A system prompt, documents of 512-1024 tokens and a question: about `size` tokens."""
    def text(n):
        return rng.integers(3, SEP, n).tolist()

    system, question = text(99) + [SEP], text(20)
    docs, total = [], len(system) + len(question)
    while total < size:
        n = int(min(rng.integers(512, 1025), max(size - total, 64)))
        docs.append(text(n - 1) + [SEP])
        total += n
    return system, docs, question


def requests_for(rng, size: int, repeats: int) -> tuple[list[dict], list[tuple[str, int]]]:
    """Every request of one size, in order, and which (method, size) each measures."""
    system, docs, question = rag_parts(rng, size)
    blend = {"separator": SEP}
    shared_salt = f"docs-{size}"
    first = {"prompt_token_ids": system + sum(docs, []) + question, "cache_salt": shared_salt,
             "kv_transfer_params": {"lmcached_blend": blend}}
    requests, labels = [first], [("store", size)]
    # The first meeting's workers store its documents over the following steps (at most
    # max_num_batched_tokens tokens a step): two one-step requests take what is left, so
    # that no measured request pays for it.
    for drain in range(2):
        requests.append({"prompt_token_ids": [3 + drain] * 8, "cache_salt": f"drain-{size}"})
        labels.append(("drain", size))
    for repeat in range(repeats):
        for name, params in METHODS:
            order = rng.permutation(len(docs)).tolist()
            prompt = system + sum((docs[i] for i in order), []) + question
            salt = f"{name}-{size}-{repeat}"
            if params is not None:  # the documents' salt; its own marker segment
                salt, marker = shared_salt, [3 + len(requests), SEP]
                prompt = system + marker + prompt[len(system):]
            if name == "prefix":  # the system prompt in vLLM's prefix cache, under this salt
                requests.append({"prompt_token_ids": system + question, "cache_salt": salt})
                labels.append(("warm-prefix", size))
            request = {"prompt_token_ids": prompt, "cache_salt": salt}
            if params is not None:
                request["kv_transfer_params"] = {"lmcached_blend": {**blend, **params}}
            requests.append(request)
            labels.append((name, size))
    return requests, labels


def random_model(out_dir: str, layers: int, hidden: int) -> str:
    """The directory of the random-weight float32 Llama of `layers` x `hidden` under
    `out_dir`, built by tests/vllm_e2e.py the first time (a later run reuses it)."""
    model = os.path.join(out_dir, f"model-{layers}x{hidden}")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, E2E, "build-model", model, "--layers", str(layers),
                        "--hidden", str(hidden), "--dtype", "float32"], check=True, timeout=600)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    model = random_model(out, args.layers, args.hidden)
    rng = np.random.default_rng(0)
    requests, labels = [], []
    for size in args.sizes:
        more, more_labels = requests_for(rng, size, args.repeats)
        requests += more
        labels += more_labels
    prompts_path, result_path = os.path.join(out, "blend.in.json"), os.path.join(out, "blend.json")
    with open(prompts_path, "w") as f:
        json.dump(requests, f)
    with temporary_daemon("--capacity", "1GiB", name=f"bench-vllm-blend-{os.getpid()}") as socket:
        cmd = [sys.executable, E2E, "run", "--model", model, "--prompts", prompts_path, "--out",
               result_path, "--socket", socket, "--mode", "ttft", "--blend-model", "--dtype",
               "float32", "--max-model-len", str(max(args.sizes) + 1024)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        with open(os.path.join(out, "blend.log"), "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True,
                           timeout=1200)
    with open(result_path) as f:
        run = json.load(f)
    samples: dict[tuple[str, int], list[float]] = {}
    cached: dict[tuple[str, int], list[int]] = {}
    for label, ttft, num_cached in zip(labels, run["ttft_s"], run["num_cached_tokens"]):
        samples.setdefault(label, []).append(1000 * ttft)
        cached.setdefault(label, []).append(num_cached)
    figures = {"layers": args.layers, "hidden": args.hidden, "blend": run.get("blend"),
               "ttft_ms": {f"{m} @{s}": v for (m, s), v in samples.items()},
               "num_cached_tokens": {f"{m} @{s}": v for (m, s), v in cached.items()}}
    print(f"TTFT, median of {args.repeats} (ms; speed-up against the full prefill of the "
          f"same size, same run), {args.layers} layers, hidden {args.hidden}, float32, CPU")
    print("method".ljust(14) + "".join(f"{size:>22}" for size in args.sizes))
    for name, _ in METHODS:
        row = name.ljust(14)
        for size in args.sizes:
            median = statistics.median(samples[(name, size)])
            full = statistics.median(samples[("full", size)])
            row += f"{median:>13.0f} ({full / median:4.2f}x)"
        print(row)
    print("store (first meeting, docs computed alone and stored, at most "
          "max_num_batched_tokens tokens a step):",
          ", ".join(f"{s}: {samples[('store', s)][0]:.0f} ms" for s in args.sizes))
    print("blend counters:", run.get("blend"))
    with open(os.path.join(out, "blend-figures.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
