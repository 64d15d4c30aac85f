"""The benchmarks of lmcached, grouped by what they measure, and their shared library.

Run each as a module from the repository root (the root is then on `sys.path`, no install
of this package needed): `python -m benchmarks.engine.bench_engine --tokens 256 4096`.

- shared, here: `common` (daemons, timings, machine facts), `report` (the suite's tables and
  plots), `memory` and `scaling` (the suite's memory and multi-process sections), `run` (the
  suite: `make bench`), `peers/` (Redis and LMCache measured beside lmcached);
- `engine/`: the client engine's store/retrieve path and the daemon's bookkeeping (CPU and
  CUDA copies, spanned views, the block pool);
- `tiers/`: the tiers under the arena and across restarts (device tiers, disk, L2, restart,
  warm start);
- `protocol/`: the wire protocol's round trips against a raw echo baseline, with its harness;
- `blend/`: CacheBlend on Hugging Face models (quality, TTFT, attention kernels) and its
  trained model;
- `hf/`, `vllm/`, `sglang/`: one folder per serving engine's integration, as in `client/`;
  `vllm/` runs under the vLLM venv.

Every benchmark writes its JSON where its `--out`/`--out-dir` says; the kept results are
in `RESULTS`.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with the repository root first on
    PYTHONPATH, so that a child `python -m benchmarks.GROUP.MODULE` imports this package
    whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH", "")]))
    return env
