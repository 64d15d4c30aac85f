"""Blend executors: which tokens are recomputed, and the long K/V each layer attends to."""

import logging
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcached.client.blend import (
    CacheBlendImpl,
    LegoLinkImpl,
    LlamaRotary,
    create_index,
    indices_to_mask,
    mask_to_indices,
)

HEADS, HEAD_DIM = 2, 8
ROPE = LlamaRotary.from_params(HEAD_DIM, 10000.0)
# Two requests; each segment is (length, tokens of it found in the cache). Request 0:
# a cached system prompt, a cached document, an uncached question. Request 1 starts
# with a partly cached document: 20 reused tokens.
BATCH = [[(4, 4), (6, 6), (3, 0)], [(5, 2), (18, 18), (2, 0)]]


def make_batch(requests, seed=0):
    """Tensors of a batch, huggingface layout [heads, N, head_dim] (token_dim 1)."""
    valid, original, lengths = [], [], []
    for segments in requests:
        lengths.append(sum(length for length, _ in segments))
        for length, hit in segments:
            valid += [True] * hit + [False] * (length - hit)
            original += list(range(hit)) + [0] * (length - hit)
    valid, original = torch.tensor(valid), torch.tensor(original)
    qsl = torch.tensor([0] + lengths).cumsum(0)
    new = torch.cat([torch.arange(n) for n in lengths])
    num_tokens = valid.numel()
    gen = torch.Generator().manual_seed(seed)
    content = torch.randn(HEADS, num_tokens, HEAD_DIM, generator=gen)  # K before RoPE
    retrieved_k = ROPE.rotate(content, original, 1)  # stored rotated at original positions
    retrieved_v = torch.randn(HEADS, num_tokens, HEAD_DIM, generator=gen)
    retrieved_k[:, ~valid] = float("nan")  # undefined where nothing was retrieved
    retrieved_v[:, ~valid] = float("nan")
    return dict(valid=valid, original=original, qsl=qsl, new=new, content=content,
                retrieved_k=retrieved_k, retrieved_v=retrieved_v)


def lay(x, token_dim):
    """An hf-layout [heads, N, head_dim] tensor in the layout of `token_dim`."""
    return x if token_dim == 1 else x.transpose(0, 1).contiguous()


def fresh(batch, rows, token_dim, seed=1, planted=None):
    """Fresh q/k/v of `rows`: K is the content rotated at the new positions (what full
    prefill would give), plus `planted` {row: deviation} added to K."""
    gen = torch.Generator().manual_seed(seed)
    k = ROPE.rotate(batch["content"][:, rows], batch["new"][rows], 1)
    for row, amount in (planted or {}).items():
        k[:, rows.tolist().index(row)] += amount
    q = torch.randn(2 * HEADS, rows.numel(), HEAD_DIM, generator=gen)
    v = torch.randn(HEADS, rows.numel(), HEAD_DIM, generator=gen)
    return lay(q, token_dim), lay(k, token_dim), lay(v, token_dim)


def call(executor, layer, batch, rows, token_dim, retrieved=True, **fresh_kw):
    q, k, v = fresh(batch, rows, token_dim, seed=10 + layer, **fresh_kw)
    rk = lay(batch["retrieved_k"], token_dim) if retrieved else None
    rv = lay(batch["retrieved_v"], token_dim) if retrieved else None
    out = executor.blend(layer, rk, rv, batch["valid"], batch["original"], q, k, v,
                         batch["new"][rows], batch["qsl"], token_dim)
    return out, (q, k, v)


def run_cacheblend(ratio, batch, token_dim, planted=None, executor=None):
    """Layers 0, 1 (check) and 2 of CacheBlend; returns (executor, check out, layer-2 out)."""
    executor = executor or CacheBlendImpl(ratio)
    executor.set_positional_encoder(ROPE.encoder)
    all_rows = torch.arange(batch["valid"].numel())
    out0, _ = call(executor, 0, batch, all_rows, token_dim)
    assert torch.equal(out0.local_indices, all_rows) and out0.query_start_loc is None
    check, _ = call(executor, 1, batch, all_rows, token_dim, planted=planted)
    after, _ = call(executor, 2, batch, check.local_indices, token_dim)
    return executor, check, after


def expected_count(ratio, batch, request):
    start, end = batch["qsl"][request], batch["qsl"][request + 1]
    valid = batch["valid"][start:end]
    return math.ceil(Fraction(str(ratio)) * int(valid.sum())) + int((~valid).sum())


def assert_consistent(out, batch):
    """local_indices ascending, positions and query_start_loc agree with them."""
    indices, qsl = out.local_indices, batch["qsl"]
    assert torch.all(indices[1:] > indices[:-1])
    assert torch.equal(out.positions, batch["new"][indices])
    for request in range(qsl.numel() - 1):
        inside = ((indices >= qsl[request]) & (indices < qsl[request + 1])).sum()
        assert out.query_start_loc[request + 1] - out.query_start_loc[request] == inside
    assert out.query_start_loc[0] == 0 and out.query_start_loc[-1] == indices.numel()


@pytest.mark.parametrize("token_dim", [0, 1])
@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3, 0.5, 1.0])
def test_selects_ceil_ratio_of_reused_plus_every_token_without_kv(ratio, token_dim):
    batch = make_batch(BATCH)
    _, check, _ = run_cacheblend(ratio, batch, token_dim)
    assert_consistent(check, batch)
    for request in range(2):
        assert (check.query_start_loc[request + 1] - check.query_start_loc[request]
                == expected_count(ratio, batch, request))
    assert torch.all(indices_to_mask(check.local_indices, batch["valid"].numel()).bool()
                     | batch["valid"])  # every token without reused KV is selected
    if ratio == 1.0:
        assert torch.equal(check.local_indices, torch.arange(batch["valid"].numel()))
    if ratio == 0.0:
        assert torch.equal(check.local_indices, mask_to_indices(~batch["valid"]))


def test_ratio_times_count_rounding_noise_does_not_add_a_token():
    batch = make_batch([[(25, 25), (2, 0)]])  # 0.28 * 25 is 7.000000000000001 in floats
    _, check, _ = run_cacheblend(0.28, batch, 1)
    assert check.local_indices.numel() == 7 + 2


@pytest.mark.parametrize("token_dim", [0, 1])
def test_the_token_whose_k_deviates_most_is_selected(token_dim):
    batch = make_batch(BATCH)
    # 0.04 picks one reused token per request (of 10 and 20); deviations are small, so
    # a K moved by the wrong delta would outweigh them.
    planted = {7: 0.05, 27: 0.05}
    _, check, _ = run_cacheblend(0.04, batch, token_dim, planted=planted)
    selected_reused = [i for i in check.local_indices.tolist() if batch["valid"][i]]
    assert selected_reused == [7, 27]


@pytest.mark.parametrize("token_dim", [0, 1])
def test_tensor_parallel_ranks_select_on_the_deviations_summed_over_ranks(token_dim):
    batch = make_batch(BATCH)
    num_tokens = batch["valid"].numel()
    other_rank = torch.zeros(num_tokens)  # the other rank's heads deviate on 8 and 30
    other_rank[[8, 30]] = 1.0
    seen = []

    def all_reduce(deviation):  # vLLM's tensor_model_parallel_all_reduce over 2 ranks
        seen.append((deviation.dtype, tuple(deviation.shape)))
        return deviation + other_rank

    executor = CacheBlendImpl(0.04, reduce_scores=all_reduce)
    _, check, _ = run_cacheblend(0.04, batch, token_dim, planted={7: 0.05, 27: 0.05},
                                 executor=executor)
    assert seen == [(torch.float32, (num_tokens,))]  # once, at the check layer
    assert [i for i in check.local_indices.tolist() if batch["valid"][i]] == [8, 30]


@pytest.mark.parametrize("token_dim", [0, 1])
def test_check_layer_returns_selected_q_and_fresh_long_kv(token_dim):
    batch = make_batch(BATCH)
    executor = CacheBlendImpl(0.3)
    executor.set_positional_encoder(ROPE.encoder)
    rows = torch.arange(batch["valid"].numel())
    call(executor, 0, batch, rows, token_dim)
    check, (q, k, v) = call(executor, 1, batch, rows, token_dim)
    assert torch.equal(check.q, q[create_index(q.dim(), token_dim, check.local_indices)])
    assert check.k is k and check.v is v


@pytest.mark.parametrize("token_dim", [0, 1])
def test_later_layers_scatter_fresh_rows_into_rerotated_reused_kv(token_dim):
    batch = make_batch(BATCH)
    executor = CacheBlendImpl(0.3)
    executor.set_positional_encoder(ROPE.encoder)
    rows = torch.arange(batch["valid"].numel())
    call(executor, 0, batch, rows, token_dim)
    selected = call(executor, 1, batch, rows, token_dim)[0].local_indices
    for layer in (2, 3):
        retrieved_k = batch["retrieved_k"].clone()
        out, (q, k, v) = call(executor, layer, batch, selected, token_dim)
        assert torch.equal(batch["retrieved_k"].nan_to_num(), retrieved_k.nan_to_num())
        assert out.q is q and out.query_start_loc is None
        assert torch.equal(out.local_indices, selected)
        assert torch.equal(out.positions, batch["new"][selected])
        kept = mask_to_indices(~indices_to_mask(selected, rows.numel()).bool())
        assert batch["valid"][kept].all()
        out_k, out_v = lay(out.k, token_dim), lay(out.v, token_dim)  # back to hf layout
        moved = ROPE.rotate(batch["retrieved_k"][:, kept],
                            batch["new"][kept] - batch["original"][kept], 1)
        assert torch.allclose(out_k[:, kept], moved, atol=1e-6, rtol=0)
        assert torch.equal(out_v[:, kept], batch["retrieved_v"][:, kept])
        assert torch.equal(out_k[:, selected], lay(k, token_dim))
        assert torch.equal(out_v[:, selected], lay(v, token_dim))
        # Equal to what full prefill computes for the reused tokens.
        full_k = ROPE.rotate(batch["content"], batch["new"], 1)
        assert torch.allclose(out_k[:, kept], full_k[:, kept], atol=1e-5, rtol=0)


def test_two_pass_rotation_equals_one_delta_rotation():
    batch = make_batch(BATCH)
    planted = {7: 0.05, 27: 0.05}
    one = run_cacheblend(0.04, batch, 1, planted=planted)[2]
    two_pass = CacheBlendImpl(0.04, delta_rotation=False)
    two_pass.set_reverse_positional_encoder(ROPE.reverse_encoder)
    two = run_cacheblend(0.04, batch, 1, planted=planted, executor=two_pass)[2]
    assert torch.equal(one.local_indices, two.local_indices)
    assert torch.allclose(one.k, two.k, atol=1e-5, rtol=0)
    assert (one.k - batch["retrieved_k"]).nan_to_num().abs().max() > 0.1  # K was moved


def test_without_an_encoder_k_is_reused_as_stored_with_one_warning(caplog):
    batch = make_batch(BATCH)
    executor = CacheBlendImpl(0.3)
    rows = torch.arange(batch["valid"].numel())
    with caplog.at_level(logging.WARNING, logger="lmcached"):
        call(executor, 0, batch, rows, 1)
        selected = call(executor, 1, batch, rows, 1)[0].local_indices
        out = call(executor, 2, batch, selected, 1)[0]
        call(executor, 3, batch, selected, 1)
    assert sum("no positional encoder" in r.getMessage() for r in caplog.records) == 1
    kept = mask_to_indices(~indices_to_mask(selected, rows.numel()).bool())
    assert torch.equal(out.k[:, kept], batch["retrieved_k"][:, kept])


@pytest.mark.parametrize("token_dim", [0, 1])
def test_nothing_retrieved_computes_every_token(token_dim):
    batch = make_batch([[(5, 0)], [(3, 0)]])
    executor = CacheBlendImpl(0.15)
    rows = torch.arange(8)
    for layer in range(4):
        out, (q, k, v) = call(executor, layer, batch, rows, token_dim, retrieved=False)
        assert torch.equal(out.local_indices, rows)
        assert torch.equal(out.q, q) and torch.equal(out.k, k) and torch.equal(out.v, v)
    assert out.query_start_loc is None


def test_one_instance_serves_request_after_request():
    executor = CacheBlendImpl(0.3)
    first = make_batch(BATCH)
    run_cacheblend(0.3, first, 1, executor=executor)
    second = make_batch([[(3, 3), (9, 9), (2, 0)]], seed=5)
    _, check, after = run_cacheblend(0.3, second, 1, executor=executor)
    assert check.local_indices.numel() == expected_count(0.3, second, 0)
    assert torch.equal(after.local_indices, check.local_indices)


def test_misuse_raises_with_the_fix():
    batch = make_batch(BATCH)
    rows = torch.arange(batch["valid"].numel())
    executor = CacheBlendImpl(0.3)
    executor.set_positional_encoder(ROPE.encoder)
    call(executor, 0, batch, rows, 1)
    with pytest.raises(ValueError, match="in order"):
        call(executor, 2, batch, rows, 1)
    call(executor, 0, batch, rows, 1)
    call(executor, 1, batch, rows, 1)
    with pytest.raises(ValueError, match="selected tokens only"):
        call(executor, 2, batch, rows, 1)  # every row instead of the selected ones
    with pytest.raises(ValueError, match="recompute_ratio"):
        CacheBlendImpl(1.5)
    with pytest.raises(ValueError, match="check_layer"):
        CacheBlendImpl(0.1, check_layer=-1)
    with pytest.raises(ValueError, match="legolink_k"):
        LegoLinkImpl(-1)
    with pytest.raises(TypeError, match="callable"):
        executor.set_positional_encoder(None)
    with pytest.raises(ValueError, match="query_start_loc"):
        executor.blend(0, None, None, torch.zeros(4, dtype=torch.bool), torch.zeros(4),
                       *[torch.zeros(1, 4, 8)] * 3, torch.arange(4), torch.tensor([0, 3]), 1)


# LegoLink. Request 0: system prompt (kept), a 6-token document (first 2 recomputed), an
# uncached token, a 1-token document (clipped to 1), an uncached question. Request 1
# starts with an uncached token, so its first document is not at its start.
LEGO_BATCH = [[(4, 4), (6, 6), (1, 0), (1, 1), (3, 0)], [(1, 0), (3, 3), (4, 4)]]
LEGO_SELECTED_K2 = [4, 5, 10, 11, 12, 13, 14, 15, 16, 17, 19, 20]


@pytest.mark.parametrize("token_dim", [0, 1])
def test_legolink_recomputes_the_first_k_of_each_later_segment(token_dim):
    batch = make_batch(LEGO_BATCH)
    executor = LegoLinkImpl(2)
    executor.set_positional_encoder(ROPE.encoder)
    rows = torch.arange(batch["valid"].numel())
    out0, (q, k, v) = call(executor, 0, batch, rows, token_dim)
    assert out0.local_indices.tolist() == LEGO_SELECTED_K2
    assert_consistent(out0, batch)
    selected = out0.local_indices
    assert torch.equal(out0.q, q[create_index(q.dim(), token_dim, selected)])
    kept = mask_to_indices(~indices_to_mask(selected, rows.numel()).bool())
    out_k = lay(out0.k, token_dim)
    moved = ROPE.rotate(batch["retrieved_k"][:, kept],
                        batch["new"][kept] - batch["original"][kept], 1)
    assert torch.allclose(out_k[:, kept], moved, atol=1e-6, rtol=0)
    assert torch.equal(out_k[:, selected], lay(k, token_dim)[:, selected])
    out1, (q1, k1, _) = call(executor, 1, batch, selected, token_dim)
    assert out1.q is q1 and out1.query_start_loc is None
    assert torch.equal(lay(out1.k, token_dim)[:, selected], lay(k1, token_dim))


@pytest.mark.parametrize("token_dim", [0, 1])
def test_legolink_names_its_layer_zero_rows_ahead_and_takes_them_alone(token_dim):
    """fresh_rows(0) is the selection; layer 0 given fresh Q/K/V of those rows only
    returns what it returns given every token's."""
    batch = make_batch(LEGO_BATCH)
    args = (batch["valid"], batch["original"], batch["qsl"])
    executor = LegoLinkImpl(2)
    executor.set_positional_encoder(ROPE.encoder)
    assert executor.fresh_rows(0, *args).tolist() == LEGO_SELECTED_K2
    assert executor.fresh_rows(1, *args) is None
    assert CacheBlendImpl(0.15).fresh_rows(0, *args) is None
    every, fresh_all = call(executor, 0, batch, torch.arange(batch["valid"].numel()), token_dim)
    rows = torch.tensor(LEGO_SELECTED_K2)
    q, k, v = (x.index_select(token_dim, rows) for x in fresh_all)
    ahead = executor.blend(0, lay(batch["retrieved_k"], token_dim),
                           lay(batch["retrieved_v"], token_dim), *args[:2], q, k, v,
                           batch["new"][rows], batch["qsl"], token_dim)
    assert ahead.q is q
    for name in ("q", "k", "v", "positions", "local_indices", "query_start_loc"):
        assert torch.equal(getattr(ahead, name), getattr(every, name)), name
    with pytest.raises(ValueError, match="or the selected ones"):
        call(executor, 0, batch, torch.tensor(LEGO_SELECTED_K2[:-1]), token_dim)


@pytest.mark.parametrize("token_dim", [0, 1])
def test_check_layer_takes_no_q_and_selects_the_same_rows(token_dim):
    """selects_from_fresh_k: at the check layer fresh_q may be None (the caller projects
    Q of the selection after blend); every other layer refuses None."""
    batch = make_batch(BATCH)
    _, check, _ = run_cacheblend(0.3, batch, token_dim)
    executor = CacheBlendImpl(0.3)
    executor.set_positional_encoder(ROPE.encoder)
    assert [executor.selects_from_fresh_k(layer) for layer in range(3)] == [False, True, False]
    assert not LegoLinkImpl(2).selects_from_fresh_k(0)
    all_rows = torch.arange(batch["valid"].numel())
    with pytest.raises(ValueError, match="fresh_q is None at layer 0"):
        executor.blend(0, None, None, torch.zeros_like(batch["valid"]), batch["original"],
                       None, *fresh(batch, all_rows, token_dim)[1:], batch["new"],
                       batch["qsl"], token_dim)
    call(executor, 0, batch, all_rows, token_dim)
    _, k, v = fresh(batch, all_rows, token_dim, seed=11)
    no_q = executor.blend(1, lay(batch["retrieved_k"], token_dim),
                          lay(batch["retrieved_v"], token_dim), batch["valid"],
                          batch["original"], None, k, v, batch["new"], batch["qsl"], token_dim)
    assert no_q.q is None
    for name in ("k", "v", "positions", "local_indices", "query_start_loc"):
        assert torch.equal(getattr(no_q, name), getattr(check, name)), name


def test_reused_k_is_rotated_with_one_table_per_batch(monkeypatch):
    """The layers after the check layer rotate the same rows by the same deltas: the
    executor hands the encoder one positions tensor per batch, and LlamaRotary computes
    its cos/sin once (torch.unique runs once per table)."""
    batch = make_batch(BATCH)
    rope = LlamaRotary.from_params(HEAD_DIM, 10000.0)
    executor = CacheBlendImpl(0.3)
    executor.set_positional_encoder(rope.encoder)
    all_rows = torch.arange(batch["valid"].numel())
    call(executor, 0, batch, all_rows, 1)
    selected = None
    calls = []
    real = torch.unique
    for layer in (1, 2, 3):
        rows = all_rows if layer == 1 else selected
        q, k, v = fresh(batch, rows, 1, seed=layer)  # before counting: fresh() rotates too
        monkeypatch.setattr(torch, "unique", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        out = executor.blend(layer, batch["retrieved_k"], batch["retrieved_v"], batch["valid"],
                             batch["original"], q, k, v, batch["new"][rows], batch["qsl"], 1)
        monkeypatch.setattr(torch, "unique", real)
        selected = out.local_indices
    assert len(calls) == 1
    kept = mask_to_indices(~indices_to_mask(selected, all_rows.numel()).bool())
    moved = ROPE.rotate(batch["retrieved_k"][:, kept],
                        batch["new"][kept] - batch["original"][kept], 1)
    assert torch.allclose(out.k[:, kept], moved, atol=1e-6, rtol=0)


def test_legolink_k_zero_and_k_large():
    batch = make_batch(LEGO_BATCH)
    rows = torch.arange(batch["valid"].numel())
    zero = call(LegoLinkImpl(0), 0, batch, rows, 1)[0]
    assert torch.equal(zero.local_indices, mask_to_indices(~batch["valid"]))
    large = call(LegoLinkImpl(100), 0, batch, rows, 1)[0]
    assert large.local_indices.tolist() == list(range(4, 23))


# Property tests against a direct model of the rules.
segment = st.tuples(st.integers(1, 7), st.integers(0, 7)).map(lambda s: (s[0], min(s)))
requests = st.lists(st.lists(segment, min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(requests=requests, ratio=st.sampled_from([0, 0.05, 0.1, 0.15, 0.2, 0.33, 0.5, 0.9, 1]),
       token_dim=st.sampled_from([0, 1]))
def test_cacheblend_selection_property(requests, ratio, token_dim):
    batch = make_batch(requests)
    _, check, after = run_cacheblend(ratio, batch, token_dim)
    assert_consistent(check, batch)
    for request in range(len(requests)):
        assert (check.query_start_loc[request + 1] - check.query_start_loc[request]
                == expected_count(ratio, batch, request))
    assert not lay(after.k, token_dim).isnan().any()  # undefined rows were all replaced


@settings(max_examples=60, deadline=None)
@given(requests=requests, k=st.integers(0, 4))
def test_legolink_selection_property(requests, k):
    batch = make_batch(requests)
    expected, start = [], 0
    for segments in requests:
        first = start
        for length, hit in segments:
            head = min(k, hit) if start != first else 0
            expected += list(range(start, start + head)) + list(range(start + hit, start + length))
            start += length
    out = call(LegoLinkImpl(k), 0, batch, torch.arange(batch["valid"].numel()), 1)[0]
    assert out.local_indices.tolist() == expected
    assert_consistent(out, batch)
