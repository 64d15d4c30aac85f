"""The Hugging Face path uses no API transformers deprecates: the demo's requests
(generate_with_cache with and without the cache, the demo's own model) and CacheBlend's
(store_segments, blend_prefill, generate_after_blend) run without a Python warning or a
warning logged by transformers, so the demo's results table carries none and the next
transformers release in our bound does not break them."""

import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcached.client import CacheEngine  # noqa: E402
from lmcached.client.hf import (  # noqa: E402
    blend_prefill,
    generate_after_blend,
    generate_with_cache,
    layout_for_model,
    store_segments,
)
from lmcached.examples.demo import SIZES, build_model  # noqa: E402

SPT = 999


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def library_warnings():
    """Every Python warning and every transformers log record >= WARNING while the test
    runs. transformers logs a deprecation once per process (`warning_once`, an
    lru_cache): the cache is emptied first, so an earlier test cannot hide one."""
    transformers.utils.logging.warning_once.cache_clear()
    handler = _Records()
    library_logger = logging.getLogger("transformers")
    library_logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [f"{w.category.__name__}: {w.message}" for w in caught] + handler.messages
    library_logger.removeHandler(handler)


def test_the_demo_requests_warn_nothing(daemon, library_warnings):
    size = SIZES["tiny"]
    model = build_model(size)
    layout = layout_for_model(model, size.chunk_size, model_name="tiny-demo")
    prompt = torch.randint(0, size.vocab_size, (3 * size.chunk_size + 5,),
                           generator=torch.Generator().manual_seed(0))
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        generate_with_cache(model, engine, prompt, size.max_new_tokens)
        warm = generate_with_cache(model, engine, prompt, size.max_new_tokens)
        cold = generate_with_cache(model, None, prompt, size.max_new_tokens)
    assert warm.num_cached_tokens > 0 and torch.equal(warm.output_ids, cold.output_ids)
    assert library_warnings() == []


def test_cacheblend_warns_nothing(daemon, library_warnings):
    size = SIZES["tiny"]
    model = build_model(size)
    layout = layout_for_model(model, 16, model_name="tiny-blend-warnings")
    gen = torch.Generator().manual_seed(1)
    docs = [torch.cat([torch.randint(0, SPT, (n,), generator=gen), torch.tensor([SPT])])
            for n in (20, 30)]
    prompt = torch.cat([*docs, torch.randint(0, SPT, (7,), generator=gen)])
    with CacheEngine.connect(layout, socket=daemon.socket, strict=True) as engine:
        store_segments(model, engine, torch.cat(docs), SPT)
        prefill = blend_prefill(model, engine, prompt, SPT)
        output_ids = generate_after_blend(model, prefill, max_new_tokens=4)
    assert prefill.num_reused_tokens > 0 and output_ids.numel() == 4
    assert library_warnings() == []
