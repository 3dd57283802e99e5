"""The control workloads' kpx-nfq side, without namespaces.

kpx-nfq has no listeners, so its apply is timed on kpx's nft set of queued
ports read with ``nft -j list set``: the parse of that listing into a count,
the names the bench gives kpx's table and sets (checked against what kpx
itself renders), which view of "in force" each mode gets, its own
convergence port, and the poll's pacing (twice the listing's cost).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import control
from bench.contenders import Kpx, KpxNfqueue, KpxWorkers, control_contenders, serves
from bench.control import (
    NFQ_PORTS_SET,
    NFQ_TABLE,
    NFQ_VIPS_SET,
    Control,
    ControlSettings,
    Listeners,
    NfqueueSets,
    nft_addresses_of,
    nft_ports_in,
    nft_set_elements,
)
from bench.topology import Topology

# What nft 1.0.6 prints for kpx's sets (`nft -j list set ip kpx_nfq ports`, `... vips`).
PORTS_LISTING = json.dumps({"nftables": [
    {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5",
                  "json_schema_version": 1}},
    {"set": {"family": "ip", "name": "ports", "table": "kpx_nfq", "type": "inet_service",
             "handle": 1, "elem": [30600, 30601, 30603, 20000, 20001, 20002, 20999]}}]})
EMPTY_LISTING = json.dumps({"nftables": [
    {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5",
                  "json_schema_version": 1}},
    {"set": {"family": "ip", "name": "ports", "table": "kpx_nfq", "type": "inet_service",
             "handle": 1}}]})
VIPS_LISTING = json.dumps({"nftables": [
    {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
    {"set": {"family": "ip", "name": "vips", "table": "kpx_nfq", "type": "ipv4_addr",
             "handle": 5, "elem": ["10.96.0.10", "10.96.0.1", "10.96.0.2"]}}]})


def test_a_port_listing_counts_only_the_ports_in_range() -> None:
    elems = nft_set_elements(PORTS_LISTING)
    assert nft_ports_in(elems, 20000, 21000) == 4  # the bench's 30600-30603 are outside
    assert nft_ports_in(elems, 20000, 20999) == 3  # hi is excluded
    assert nft_ports_in(elems, 20001, 20002) == 1


def test_an_empty_set_has_no_elem_key_and_counts_zero() -> None:
    assert nft_set_elements(EMPTY_LISTING) == []
    assert nft_ports_in([], 20000, 21000) == 0


def test_elements_with_options_and_ranges_count_by_value() -> None:
    listing = json.dumps({"nftables": [{"set": {"name": "ports", "elem": [
        {"elem": {"val": 20005, "timeout": 30, "expires": 29}},
        {"range": [20010, 20019]},
        {"range": [19990, 20001]},
    ]}}]})
    elems = nft_set_elements(listing)
    assert elems[0] == 20005
    assert nft_ports_in(elems, 20000, 20015) == 1 + 5 + 2


@pytest.mark.parametrize(("listing", "needle"), [
    ("Error: No such file", "not JSON"),
    ("[]", "no \"nftables\" array"),
    (json.dumps({"nftables": [{"metainfo": {}}]}), "holds 0 sets"),
    (json.dumps({"nftables": [{"set": {"name": "a"}}, {"set": {"name": "b"}}]}), "holds 2 sets"),
    (json.dumps({"nftables": [{"set": {"name": "ports", "elem": 5}}]}), "'ports'"),
])
def test_a_listing_that_is_not_one_set_is_refused(listing: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        nft_set_elements(listing)


@pytest.mark.parametrize("bad", ["http", True, {"prefix": {}}, {"range": [1]}])
def test_a_port_element_that_is_no_port_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="not a port"):
        nft_ports_in([20000, bad], 20000, 21000)


def test_vips_in_force_are_the_wanted_ones_in_the_set() -> None:
    elems = nft_set_elements(VIPS_LISTING)
    want = frozenset({"10.96.0.1", "10.96.0.2", "10.96.0.3"})
    assert nft_addresses_of(elems, want) == 2  # the bench service's 10.96.0.10 not counted
    with pytest.raises(ValueError, match="not an address"):
        nft_addresses_of([1], want)


def test_the_bench_names_kpx_nfqueue_table_and_sets_as_kpx_renders_them() -> None:
    """bench may not import proxy: its own names must match kpx's rendering."""
    rules = pytest.importorskip("proxy.nfqueue.rules")
    assert rules.NFT_TABLE == NFQ_TABLE
    served = rules.Served(ports=frozenset({20000}), vips=frozenset({"10.96.0.1"}))
    script = rules.nft_script(rules.QueueConfig(), served, "xt")
    assert f"table ip {NFQ_TABLE} {{" in script
    assert f"set {NFQ_PORTS_SET} {{ type inet_service; elements = {{ 20000 }}" in script
    assert f"set {NFQ_VIPS_SET} {{ type ipv4_addr; elements = {{ 10.96.0.1 }}" in script


def test_control_runs_for_each_proxy_mode_once() -> None:
    assert serves("kpx-nfq", "control") is None
    assert serves("kpx", "control") is None
    assert "once per proxy mode" in (KpxWorkers.serves("control") or "")
    assert KpxNfqueue.serves("mem")  # still n/a: conntrack holds the connections
    assert control_contenders(["kpx-nfq", "haproxy", "kpx-w2", "kpx", "kernel"]) == [
        "kpx", "kpx-nfq"]
    assert control_contenders(["kpx-nfq"]) == ["kpx-nfq"]
    assert control_contenders(["haproxy", "direct"]) == []


def _control(cls: type[Kpx], tmp_path: Path, cs: ControlSettings | None = None) -> Control:
    """A Control over a contender that is never started (no namespace is touched)."""
    return Control(cls(Topology(prefix="kbtest-"), tmp_path, "kpx"), cs or ControlSettings())


def test_each_mode_gets_its_view_and_its_own_conv_port(tmp_path: Path) -> None:
    relay, nfq = _control(Kpx, tmp_path), _control(KpxNfqueue, tmp_path)
    assert isinstance(relay.view, Listeners) and relay.view.what == "listening"
    assert isinstance(nfq.view, NfqueueSets) and "kpx_nfq ports" in nfq.view.what
    assert relay.conv_port == 30402  # the relay's, as before
    assert nfq.conv_port == 30602
    assert "nodePort: 30602" in nfq.state(3, "pod1-b")
    assert "nodePort: 30402" in relay.state(3, "pod1-b")


def test_the_stall_state_is_the_same_for_both_modes(tmp_path: Path) -> None:
    cs = ControlSettings(stall_services=300, stall_node_ports=60)
    relay, nfq = _control(Kpx, tmp_path, cs), _control(KpxNfqueue, tmp_path, cs)
    (rt, rn), (nt, nn) = relay.stall_state(), nfq.stall_state()
    assert rn == nn == 60
    # The same services; only the bench service's own NodePorts (each mode's base) differ.
    assert rt.replace("304", "306") == nt


class _Stub:
    """A view whose poll costs ``cost`` seconds (busy, not slept) and counts up."""

    what = "stubbed"

    def __init__(self, cost: float, factor: float) -> None:
        self.cost, self.cost_factor, self.count = cost, factor, 0

    def node_ports(self, lo: int, hi: int) -> int:
        end = time.monotonic() + self.cost
        while time.monotonic() < end:
            pass
        self.count += 1
        return self.count

    def vips(self, want: frozenset[str]) -> int:
        return len(want)


@pytest.mark.parametrize(("factor", "least"), [(0.0, 0.01), (2.0, 0.04)])
def test_a_poll_pauses_at_least_its_cost_times_the_views_factor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factor: float, least: float) -> None:
    ctl = _control(KpxNfqueue, tmp_path)
    ctl.view = _Stub(0.02, factor)
    pauses: list[float] = []
    monkeypatch.setattr(control.time, "sleep", pauses.append)
    ok, count = ctl.wait_count(10, lambda c: c >= 3, 0.01)
    assert ok and count == 3
    assert len(pauses) == 2 and len(ctl.polls) == 3
    assert all(p >= least for p in pauses), pauses
    if factor == 0.0:
        assert pauses == [0.01, 0.01]  # the relay's fixed interval, unchanged
    detail = ctl._poll_detail()
    assert detail["polls"] == 3 and detail["poll_ms_mean"] >= 20.0
