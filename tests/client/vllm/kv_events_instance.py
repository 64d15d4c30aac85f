"""A vLLM (CPU) instance with the lmcached connector and vLLM's ZMQ KV event publisher on,
driven by a test one request batch at a time (test_vllm_kv_events.py).

Runs in its own process (in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0)::

    python kv_events_instance.py --model DIR --socket S --endpoint tcp://127.0.0.1:PORT [--chunk-size 256]

`--endpoint` is the publisher's `--kv-events-config` endpoint: vLLM connects a PUB socket
to an address without a wildcard, so the test binds its SUB socket there first.

Protocol: one JSON object per line on stdin; each answer is one stdout line starting with
`RESULT ` (vLLM logs to stdout too):
    {"prompts": [P, ...], "max_tokens": N}  generate; a prompt is {"prompt_token_ids": [...],
        "cache_salt": str (optional)}; answer {"num_cached_tokens": [...]}
    {"relay_stats": true}                   answer the connector's event relay's `stats`
    {"quit": true}                          answer {"quit": true}, then exit
The instance answers {"ready": true} once vLLM has started.
"""

import argparse
import json
import sys

MARK = "RESULT "


def answer(result: dict) -> None:
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=2048, seed=0,
              kv_transfer_config={
                  "kv_connector": "LMCachedConnector",
                  "kv_connector_module_path": "lmcached.client.vllm_connector",
                  "kv_role": "kv_both",
                  "kv_connector_extra_config": {"socket": args.socket,
                                                "chunk_size": args.chunk_size}},
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=args.endpoint, topic="kv-events"))
    answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        if command.get("relay_stats"):
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            answer(dict(connector.event_relay.stats))
            continue
        params = SamplingParams(temperature=0.0, max_tokens=command.get("max_tokens", 1),
                                ignore_eos=True, detokenize=False)
        outs = llm.generate(command["prompts"], params, use_tqdm=False)
        answer({"num_cached_tokens": [o.num_cached_tokens for o in outs]})
    del llm
    answer({"quit": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
