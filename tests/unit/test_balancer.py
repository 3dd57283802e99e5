"""proxy.core.balancer: round-robin spread and ClientIP affinity, with injected time."""

from __future__ import annotations

from collections import Counter

import pytest

from proxy.core import balancer
from proxy.core.balancer import Balancer
from proxy.core.endpoints import EndpointInfo

EPS = tuple(EndpointInfo(f"10.244.0.{i}", 8080, "node-a", True) for i in range(1, 4))
TIMEOUT = 125.0  # the e2e SessionAffinityTimeout
CLIENT = "198.51.100.20"


def addr(ep: EndpointInfo | None) -> str:
    assert ep is not None
    return ep.ip


def test_round_robin_spreads_evenly() -> None:
    b = Balancer()
    picks = Counter(addr(b.pick(EPS, f"198.51.100.{i % 7}", float(i))) for i in range(300))
    assert picks == {ep.ip: 100 for ep in EPS}


def test_round_robin_order_is_the_candidate_order() -> None:
    b = Balancer()
    assert [addr(b.pick(EPS, CLIENT, 0.0)) for _ in range(6)] == [e.ip for e in EPS + EPS]


def test_round_robin_survives_a_shrinking_candidate_list() -> None:
    b = Balancer()
    for _ in range(2):
        b.pick(EPS, CLIENT, 0.0)
    two = EPS[:2]
    picks = [addr(b.pick(two, CLIENT, 0.0)) for _ in range(4)]
    assert Counter(picks) == {EPS[0].ip: 2, EPS[1].ip: 2}


def test_no_candidates_or_all_excluded_is_none() -> None:
    b = Balancer()
    assert b.pick((), CLIENT, 0.0) is None
    assert b.pick(EPS, CLIENT, 0.0, TIMEOUT, exclude={e.addr for e in EPS}) is None


def test_exclude_skips_failed_endpoints() -> None:
    b = Balancer()
    exclude = {EPS[0].addr}
    assert {addr(b.pick(EPS, CLIENT, 0.0, exclude=exclude)) for _ in range(6)} == {
        EPS[1].ip,
        EPS[2].ip,
    }


# -- ClientIP affinity ------------------------------------------------------------


def test_affinity_holds_for_15_connections() -> None:
    # checkAffinity in test/e2e/network/service.go: AffinityConfirmCount = 15.
    b = Balancer()
    picks = {addr(b.pick(EPS, CLIENT, float(t), TIMEOUT)) for t in range(15)}
    assert len(picks) == 1


def test_affinity_is_per_client_ip() -> None:
    b = Balancer()
    first = addr(b.pick(EPS, "198.51.100.1", 0.0, TIMEOUT))
    second = addr(b.pick(EPS, "198.51.100.2", 0.0, TIMEOUT))
    assert first != second
    assert addr(b.pick(EPS, "198.51.100.1", 1.0, TIMEOUT)) == first
    assert b.sticky_target("198.51.100.2") == (second, 8080)


def test_affinity_expires_after_the_timeout() -> None:
    b = Balancer()
    first = addr(b.pick(EPS, CLIENT, 0.0, TIMEOUT))
    assert addr(b.pick(EPS, CLIENT, TIMEOUT - 0.001, TIMEOUT)) == first
    # The e2e timeout test waits 130 s between requests and expects a new backend.
    assert addr(b.pick(EPS, CLIENT, TIMEOUT - 0.001 + 130.0, TIMEOUT)) != first


def test_each_pick_refreshes_the_timer() -> None:
    b = Balancer()
    first = addr(b.pick(EPS, CLIENT, 0.0, TIMEOUT))
    # Ten picks 100 s apart: 1000 s in all, far beyond the timeout, never idle that long.
    for t in range(1, 11):
        assert addr(b.pick(EPS, CLIENT, t * 100.0, TIMEOUT)) == first


def test_vanished_target_is_replaced_and_the_new_one_sticks() -> None:
    b = Balancer()
    first = b.pick(EPS, CLIENT, 0.0, TIMEOUT)
    remaining = tuple(e for e in EPS if e != first)
    replacement = addr(b.pick(remaining, CLIENT, 1.0, TIMEOUT))
    assert replacement != addr(first)
    # Even when the old endpoint comes back, the client stays on its new one.
    assert addr(b.pick(EPS, CLIENT, 2.0, TIMEOUT)) == replacement


def test_excluded_target_is_replaced() -> None:
    b = Balancer()
    first = b.pick(EPS, CLIENT, 0.0, TIMEOUT)
    assert first is not None
    retry = addr(b.pick(EPS, CLIENT, 0.5, TIMEOUT, exclude={first.addr}))
    assert retry != first.ip and b.sticky_target(CLIENT) == (retry, 8080)


def test_forget_drops_the_record() -> None:
    b = Balancer()
    first = addr(b.pick(EPS, CLIENT, 0.0, TIMEOUT))
    b.forget(CLIENT)
    assert b.sticky_target(CLIENT) is None
    assert addr(b.pick(EPS, CLIENT, 1.0, TIMEOUT)) != first  # round-robin moved on
    b.forget("203.0.113.99")  # unknown clients are fine


def test_switching_affinity_off_forgets_every_record() -> None:
    # e2e "should be able to switch session affinity": ClientIP -> None -> ClientIP.
    b = Balancer()
    b.pick(EPS, CLIENT, 0.0, TIMEOUT)
    spread = {addr(b.pick(EPS, CLIENT, 1.0)) for _ in range(3)}
    assert len(spread) == 3
    assert b.sticky_target(CLIENT) is None
    again = addr(b.pick(EPS, CLIENT, 2.0, TIMEOUT))
    assert {addr(b.pick(EPS, CLIENT, 3.0 + t, TIMEOUT)) for t in range(15)} == {again}


def test_reap_removes_only_expired_records() -> None:
    b = Balancer()
    b.pick(EPS, "198.51.100.1", 0.0, TIMEOUT)
    b.pick(EPS, "198.51.100.2", 100.0, TIMEOUT)
    b.reap(150.0, TIMEOUT)
    assert b.sticky_target("198.51.100.1") is None
    assert b.sticky_target("198.51.100.2") is not None


def test_memory_is_bounded_by_periodic_reaping() -> None:
    b = Balancer()
    for i in range(1000):
        b.pick(EPS, f"10.1.{i // 250}.{i % 250}", 0.0, TIMEOUT)
    assert b.sticky_target("10.1.0.0") is not None
    # Long after they expired, ordinary traffic from one client sweeps them out.
    for t in range(30):
        b.pick(EPS, CLIENT, 1000.0 + t, TIMEOUT)
    assert all(b.sticky_target(f"10.1.{i // 250}.{i % 250}") is None for i in range(1000))
    assert b.sticky_target(CLIENT) is not None


def test_records_are_bounded_and_the_least_recently_used_goes_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A UDP client varies its source for free: past ``MAX_STICKY`` records, the one used
    longest ago is dropped, never a client that keeps coming."""
    monkeypatch.setattr(balancer, "MAX_STICKY", 4)
    b = Balancer()
    for i in range(4):
        b.pick(EPS, f"198.51.100.{i}", float(i), TIMEOUT)
    b.pick(EPS, "198.51.100.0", 4.0, TIMEOUT)  # the first one comes back: the newest now
    for i in range(10, 13):
        b.pick(EPS, f"198.51.100.{i}", float(i), TIMEOUT)
    kept = [c for c in (f"198.51.100.{i}" for i in (*range(4), *range(10, 13)))
            if b.sticky_target(c) is not None]
    assert kept == ["198.51.100.0", "198.51.100.10", "198.51.100.11", "198.51.100.12"]


def test_a_flood_of_sources_keeps_the_records_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(balancer, "MAX_STICKY", 1000)
    b = Balancer()
    for i in range(50_000):
        b.pick(EPS, f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", i / 1000, TIMEOUT)
    assert len(b._sticky) == 1000
    assert b.sticky_target("10.0.195.79") is not None  # the last one, i = 49,999
