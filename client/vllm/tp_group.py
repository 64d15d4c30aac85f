"""Collectives of the connector's workers over vLLM's tensor parallel group (its CPU group).

Why this file exists: the workers of one engine must agree on load errors (every rank
reports the same ones) and, for CacheBlend, on deviation scores and hits, or one rank
waits for ever in a collective.
"""

import numpy as np
import torch

from lmcached.client.vllm.blend_worker import TensorParallelGroup


def tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0


def blend_tp_group() -> TensorParallelGroup:
    """CacheBlend's collectives over vLLM's TP group (its CPU group: a few KiB a blend)."""
    from vllm.distributed.parallel_state import get_tp_group

    def sum_scores(scores: torch.Tensor) -> torch.Tensor:
        total = scores.to("cpu", torch.float32, copy=True)
        torch.distributed.all_reduce(total, group=get_tp_group().cpu_group)
        return total.to(scores.device)

    def min_flags(flags: torch.Tensor) -> torch.Tensor:
        least = flags.to("cpu", torch.int64, copy=True)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN,
                                     group=get_tp_group().cpu_group)
        return least

    return TensorParallelGroup(sum_scores=sum_scores, min_flags=min_flags)


def all_ranks_first_failure(failed: list[int]) -> list[int]:
    """Per load, the first chunk that failed on ANY TP rank (collective on the CPU group).

    Every rank takes part whenever the metadata has loads (identical on all ranks), so
    all ranks report the same load errors and skip the same saves.
    """
    from vllm.distributed.parallel_state import get_tp_group

    big = np.iinfo(np.int64).max
    flags = torch.tensor([big if f < 0 else f for f in failed], dtype=torch.int64)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN,
                                 group=get_tp_group().cpu_group)
    return [-1 if f == big else int(f) for f in flags.tolist()]
