"""Generated requests (hypothesis) against a real server: the status always matches an independent oracle,
never INTERNAL/UNKNOWN, and the server keeps serving."""

from __future__ import annotations

import math
import unicodedata

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from recsvc.client.client import RecClient
from recsvc.service.gen import recommender_pb2 as pb

CATALOG = range(1, 2001)  # the `catalog` fixture's items
INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` 7 times in 8, so that a fair share of whole requests is valid (each field can break it)."""
    # not i == 0: hypothesis favours boundary values, which would make `anything` the common case
    return st.integers(0, 799).flatmap(lambda i: anything if i % 8 == 3 else valid)


user_ids = mostly(
    st.one_of(st.sampled_from(["u1", "alice", "x" * 128, "ü-ser"]), st.text(min_size=1, max_size=20)),
    st.one_of(st.sampled_from(["x" * 129, "", "tab\tuser", "nul\x00"]), st.text(max_size=140)),
)
item_lists = mostly(
    st.lists(st.integers(1, 2000), max_size=6),
    st.one_of(
        st.lists(st.one_of(st.integers(1, 2000), INT64), max_size=6),
        st.sampled_from([list(range(1, 201)), list(range(1, 202)), [7] * 199 + [0]]),  # the 200-item limit
    ),
)


def _valid_user(user_id: str) -> bool:
    return 0 < len(user_id) <= 128 and not any(unicodedata.category(c) in ("Cc", "Cs") for c in user_id)


def _known(items) -> bool:
    return all(item in CATALOG for item in items)


def _call(fn):
    try:
        return grpc.StatusCode.OK, fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


@st.composite
def recommend_requests(draw) -> pb.RecommendRequest:
    request = pb.RecommendRequest(
        user_id=draw(user_ids),
        history=draw(item_lists),
        mode=draw(mostly(st.sampled_from([0, 1, 2, 3]), INT32)),
        exclude_items=draw(mostly(st.lists(INT64, max_size=6), st.sampled_from([[3] * 1000, [3] * 1001]))),
        exclude_history=draw(st.booleans()),
    )
    k = draw(mostly(st.one_of(st.none(), st.integers(1, 50)), st.one_of(st.integers(-2, 55), INT32, INT64)))
    if k is not None:
        request.k = k
    temperature = draw(
        mostly(
            st.one_of(st.none(), st.floats(0.25, 8.0, width=32)),
            st.one_of(st.floats(width=32), st.sampled_from([1e-45, 1e-38, 1e-20, 0.049, 0.05, 10.0, 10.5])),
        )
    )
    if temperature is not None:
        request.temperature = temperature
    seed = draw(st.one_of(st.none(), INT64))
    if seed is not None:
        request.seed = seed
    return request


def _recommend_is_valid(r: pb.RecommendRequest) -> bool:
    return (
        _valid_user(r.user_id)
        and r.mode in (0, 1, 2, 3)
        and (not r.HasField("k") or 1 <= r.k <= 50)
        and (not r.HasField("temperature") or (math.isfinite(r.temperature) and 0.05 <= r.temperature <= 10))
        and len(r.history) <= 200
        and _known(r.history)
        and len(r.exclude_items) <= 1000
    )


@pytest.fixture
def fuzz_server(catalog, make_server):
    server = make_server(catalog, max_wait_ms=0.5)
    with RecClient(server.address, timeout_s=10) as client:
        yield client


@settings(max_examples=300, **SETTINGS)
@given(request=recommend_requests())
def test_recommend_fuzz(fuzz_server, request):
    code, reply = _call(lambda: fuzz_server.stub.Recommend(request, timeout=10))
    event(f"status {code.name}")
    if not _recommend_is_valid(request):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, reply)
        assert reply  # a message that says what is wrong
        return
    assert code == grpc.StatusCode.OK, (code, reply)
    k = request.k if request.HasField("k") else 10
    items = [item.item_id for item in reply.items]
    assert len(items) == k and len(set(items)) == k
    excluded = set(request.exclude_items) | (set(request.history) if request.exclude_history else set())
    assert not excluded & set(items)
    assert bool(reply.fallback_reason) == (not request.history)  # this server never stores history
    # a popularity table answers (POPULARITY: no decoding ran); the requested mode is resolved (never UNSPECIFIED)
    assert reply.stats.mode == 4 and reply.stats.requested_mode in (1, 2, 3)


@settings(max_examples=150, **SETTINGS)
@given(
    user_id=st.one_of(st.sampled_from(["a", "b", ""]), user_ids),
    items=st.one_of(item_lists, st.lists(st.integers(1, 2000), min_size=0, max_size=0)),
)
def test_record_and_history_fuzz(fuzz_server, user_id, items):
    before_code, before = _call(lambda: fuzz_server.history(user_id))
    code, reply = _call(lambda: fuzz_server.record(user_id, items))
    valid = _valid_user(user_id) and 0 < len(items) <= 200 and _known(items)
    if not valid:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, reply)
        return
    assert before_code == grpc.StatusCode.OK
    expected = (before + list(items))[-200:]
    assert code == grpc.StatusCode.OK and reply == len(expected)
    assert fuzz_server.history(user_id) == expected


@settings(max_examples=150, **SETTINGS)
@given(
    method=st.sampled_from(["Recommend", "RecordInteractions", "GetHistory"]),
    payload=st.one_of(st.binary(max_size=64), st.binary(min_size=1, max_size=8).map(lambda b: b"\n" + b)),
)
def test_arbitrary_bytes_never_internal(fuzz_server, method, payload):
    call = fuzz_server.channel.unary_unary(f"/recsvc.v1.Recommender/{method}")
    code, reply = _call(lambda: call(payload, timeout=10))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, reply)
    assert fuzz_server.health() == "SERVING"
