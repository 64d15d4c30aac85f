"""CacheBlend's scheduler side (client/vllm/blend_scheduler.py) against a real daemon,
without vLLM: which blend requests are claimed, stored only, deferred or refused (and
counted). vLLM's Request and KVCacheBlocks are small stand-ins with the attributes read.
"""

import types

import pytest
import torch

from lmcached.client import CacheEngine, KVLayout
from lmcached.client.vllm.blend_params import BlendParams, blend_params, parse_blend_params
from lmcached.client.vllm.blend_scheduler import BlendScheduler
from lmcached.client.vllm.specs import ConnectorSettings

SEP = 99
CHUNK = 8
SEGMENTS = KVLayout("blend-sched-test", num_layers=2, num_kv_heads=1, head_size=8,
                    dtype="float32", chunk_size=CHUNK, fmt="vllm")
SYSTEM = [5, 6, 7, SEP]
DOC = [11, 12, 13, 14, 15, SEP]
QUESTION = [21, 22, 23]


def make_settings(socket: str) -> ConnectorSettings:
    return ConnectorSettings(layouts=[SEGMENTS], chunk_size=CHUNK, block_size=4, world_size=1,
                             socket=socket, daemon_name="unused", timeout_s=5.0)


def fake_request(request_id: str, tokens, salt="s", **blend) -> types.SimpleNamespace:
    """The attributes of vllm.v1.request.Request the blend scheduler reads."""
    params = {"separator": SEP, **blend}
    return types.SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(tokens), lora_request=None,
        mm_features=None, cache_salt=salt, kv_transfer_params={"lmcached_blend": params})


def step_output(*requests) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in requests})


def fake_blocks(num_blocks: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_block_ids=lambda: (list(range(100, 100 + num_blocks)),))


def store_segment(socket: str, tokens, salt: str = "s") -> None:
    """Store one segment alone under a cache salt (fake_request's by default), as a blend
    worker does."""
    kv = torch.randn(SEGMENTS.num_layers, 2, len(tokens), 1, 8)
    with CacheEngine.connect(SEGMENTS, socket, strict=True) as engine:
        assert engine.store(tokens, kv, cache_salt=salt) == 1


@pytest.mark.parametrize("raw, expected", [
    ({"separator": 7}, BlendParams(7)),
    ({"separator": 7, "recompute_ratio": 1}, BlendParams(7, recompute_ratio=1.0)),
    ({"separator": 7, "strategy": "legolink", "legolink_k": 4},
     BlendParams(7, "legolink", legolink_k=4)),
    ({}, None),
    ({"separator": "7"}, None),
    ({"separator": True}, None),
    ({"separator": 7, "recompute_ratio": 1.5}, None),
    ({"separator": 7, "strategy": "epic"}, None),
    ({"separator": 7, "legolink_k": -1}, None),
    ({"separator": 7, "ratio": 0.1}, None),  # unknown key: a typo is not silently ignored
    ([7], None),
    ({"separator": 2**31 - 1, "legolink_k": 1 << 20}, BlendParams(2**31 - 1, legolink_k=1 << 20)),
    ({"separator": 2**31}, None),  # no token id
    ({"separator": 2**63}, None),  # beyond int64: numpy would raise OverflowError
    ({"separator": -(2**63) - 1}, None),
    ({"separator": 7, "strategy": "legolink", "legolink_k": 10**30}, None),
    ({"separator": 7, "strategy": "legolink", "legolink_k": 2**63}, None),  # would wrap
    ({"separator": 7, "legolink_k": (1 << 20) + 1}, None),
    ({"separator": 7, "recompute_ratio": float("nan")}, None),
    ({"separator": 7, "recompute_ratio": float("inf")}, None),
    ({"separator": 7, "recompute_ratio": 10**400}, None),
    ({"separator": 7, "strategy": ["cacheblend"]}, None),  # unhashable: no TypeError
])
def test_blend_params_accept_only_what_the_design_defines(raw, expected):
    assert parse_blend_params(raw) == expected


@pytest.mark.parametrize("change, reason", [
    ({"cache_salt": None}, "unsalted"),
    ({"lora_request": object()}, "lora"),
    ({"mm_features": [object()]}, "multimodal"),
    ({"kv_transfer_params": {"lmcached_blend": {"separator": -1}}}, "bad_params"),
    ({"kv_transfer_params": None}, None),
    ({"kv_transfer_params": {"other": 1}}, None),
])
def test_requests_the_design_refuses_are_named(change, reason):
    request = fake_request("r", SYSTEM + QUESTION)
    vars(request).update(change)
    assert blend_params(request) == (None, reason)


@pytest.mark.parametrize("blend, named", [
    ({"separator": 2**63}, "separator 9223372036854775808 is not a token id"),
    ({"separator": 10**50}, "separator 1000000000000000000000000000000000000..."),
    ({"strategy": "legolink", "legolink_k": 10**30}, f"legolink_k {10**30} is not"),
    ({"strategy": "legolink", "legolink_k": 2**63}, "legolink_k 9223372036854775808 is"),
    ({"recompute_ratio": float("nan")}, "recompute_ratio nan"),
])
def test_out_of_range_blend_parameters_are_a_counted_refusal_not_an_exception(
        daemon, blend, named, caplog):
    """A separator or legolink_k beyond any bound is refused where it is parsed: the
    request is served normally (False, 0), counted under bad_params, and the one warning
    names the parameter; a second such request is counted without a second warning."""
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS)
    for n in range(2):
        request = fake_request(f"r{n}", SYSTEM + DOC + QUESTION, **blend)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (False, 0)
        assert not scheduler.handles(request)
    assert scheduler.refusals == {"bad_params": 2}
    warnings = [r.getMessage() for r in caplog.records if "served normally" in r.getMessage()]
    assert len(warnings) == 1 and named in warnings[0], warnings
    scheduler.shutdown()


def test_nothing_cached_is_store_only_then_the_documents_are_claimed(daemon):
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS)
    prompt = SYSTEM + DOC + QUESTION
    first = fake_request("first", prompt)
    assert scheduler.get_num_new_matched_tokens(first, 0) == (True, 0)
    scheduler.update_state_after_alloc(first, fake_blocks(4), 0)
    (spec,) = scheduler.build_step(step_output(first))
    assert spec.store_only and spec.tokens.tolist() == SYSTEM + DOC
    assert scheduler.build_step(step_output(first)) == []  # sent once

    store_segment(daemon.socket, DOC)
    second = fake_request("second", prompt)
    # Claimed up to the start of the last segment, beyond vLLM's own hit.
    assert scheduler.get_num_new_matched_tokens(second, 4) == (True, len(SYSTEM + DOC) - 4)
    scheduler.update_state_after_alloc(second, fake_blocks(4), len(SYSTEM + DOC) - 4)
    (spec,) = scheduler.build_step(step_output(second))
    assert not spec.store_only
    assert (spec.num_local_tokens, spec.block_ids) == (4, [100, 101, 102, 103])
    assert scheduler.num_claimed_requests == 1 and scheduler.refusals == {}
    scheduler.shutdown()


def test_documents_are_claimed_only_under_the_salt_they_were_stored_under(daemon):
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS)
    store_segment(daemon.socket, DOC, salt="tenant-a")
    prompt = SYSTEM + DOC + QUESTION
    other = fake_request("b", prompt, salt="tenant-b")
    assert scheduler.get_num_new_matched_tokens(other, 0) == (True, 0)  # store-only
    scheduler.update_state_after_alloc(other, fake_blocks(4), 0)
    (spec,) = scheduler.build_step(step_output(other))
    assert spec.store_only and spec.cache_salt == "tenant-b"  # stored under its own salt
    same = fake_request("a", prompt, salt="tenant-a")
    assert scheduler.get_num_new_matched_tokens(same, 0) == (True, len(SYSTEM + DOC))
    scheduler.update_state_after_alloc(same, fake_blocks(4), len(SYSTEM + DOC))
    (spec,) = scheduler.build_step(step_output(same))
    assert not spec.store_only and spec.cache_salt == "tenant-a"
    assert scheduler.num_claimed_requests == 1 and scheduler.num_store_only_requests == 1
    scheduler.shutdown()


def test_served_normally_requests_are_counted_by_reason(daemon, short_tmp):
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS)
    store_segment(daemon.socket, DOC)
    cases = [(fake_request("unsalted", SYSTEM + DOC + QUESTION, salt=None), 0),
             (fake_request("one", QUESTION), 0),
             (fake_request("local", SYSTEM + DOC + QUESTION), len(SYSTEM + DOC))]
    for request, local in cases:
        assert scheduler.get_num_new_matched_tokens(request, local) == (False, 0)
        assert not scheduler.handles(request)
    assert scheduler.refusals == {"unsalted": 1, "one_segment": 1, "local_hit": 1}
    scheduler.shutdown()

    down = BlendScheduler(make_settings(f"{short_tmp}/nobody.sock"), SEGMENTS)
    assert down.get_num_new_matched_tokens(fake_request("d", SYSTEM + DOC), 0) == (False, 0)
    assert down.refusals == {"daemon_unavailable": 1}
    down.shutdown()
    refused = BlendScheduler(make_settings(daemon.socket), SEGMENTS, refuse_all="no_model")
    assert refused.get_num_new_matched_tokens(fake_request("m", SYSTEM + DOC), 0) == (False, 0)
    assert refused.refusals == {"no_model": 1}


def test_blend_work_beyond_the_step_budget_is_asked_again(daemon):
    store_segment(daemon.socket, DOC)
    claim = len(SYSTEM + DOC)
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS,
                               tokens_per_step=claim + 1)
    one, two = (fake_request(name, SYSTEM + DOC + QUESTION) for name in ("one", "two"))
    assert scheduler.get_num_new_matched_tokens(one, 0) == (True, claim)
    assert scheduler.get_num_new_matched_tokens(two, 0) == (True, None)  # ask again
    scheduler.update_state_after_alloc(one, fake_blocks(4), claim)
    assert len(scheduler.build_step(step_output(one))) == 1
    assert scheduler.get_num_new_matched_tokens(two, 0) == (True, claim)  # next step
    assert scheduler.num_deferred == 1
    scheduler.shutdown()


def test_a_request_scheduled_again_from_scratch_is_blended_again(daemon):
    store_segment(daemon.socket, DOC)
    scheduler = BlendScheduler(make_settings(daemon.socket), SEGMENTS)
    request = fake_request("preempted", SYSTEM + DOC + QUESTION)
    claim = len(SYSTEM + DOC)
    for blocks in (fake_blocks(4), types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 6],))):
        # vLLM preempted it and recomputes it: new blocks, and they need the blend again.
        assert scheduler.get_num_new_matched_tokens(request, 0) == (True, claim)
        scheduler.update_state_after_alloc(request, blocks, claim)
        (spec,) = scheduler.build_step(step_output(request))
        assert spec.block_ids == blocks.get_block_ids()[0] and not spec.store_only
    scheduler.shutdown()
