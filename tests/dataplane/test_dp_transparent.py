"""The transparent-mode pieces that need no namespace: ruleset text, sockets.

Installing and removing the routing is tested only inside a test namespace
(test_dp_netns.py); nothing here changes any routing or firewall state.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from proxy.userspace.transparent import (
    IP_TRANSPARENT,
    RoutingConfig,
    TransparentRouting,
    close_time_wait_legs,
    nft_ruleset,
    upstream_socket,
)


def test_ruleset_replaces_the_table_atomically() -> None:
    text = nft_ruleset(RoutingConfig(mark=0x1234, nft_table="t1"))
    lines = [ln.strip() for ln in text.splitlines()]
    # Declare, delete, recreate: one transaction, whether or not a leftover exists.
    assert lines[:3] == ["table inet t1", "delete table inet t1", "table inet t1 {"]
    assert "type filter hook prerouting priority mangle; policy accept;" in lines
    assert ("meta l4proto { tcp, udp } socket transparent 1"
            " meta mark set meta mark or 0x1234") in lines


def test_default_mark_is_one_bit_clear_of_other_proxies() -> None:
    cfg = RoutingConfig()
    assert bin(cfg.mark).count("1") == 1
    assert cfg.mark & 0xC000 == 0  # kube-proxy's masquerade/drop bits
    assert cfg.mark & 0xFFFF0F00 == 0  # Calico's high bits, Cilium's 0x0F00
    assert 0 < cfg.rule_pref < 32766 and cfg.table not in (253, 254, 255)


def test_remove_without_install_touches_nothing() -> None:
    r = TransparentRouting()
    r.remove()  # never installed: must not run any command
    assert r.active is False


def test_snat_upstream_socket_is_plain_and_nonblocking() -> None:
    s = upstream_socket(None)
    try:
        assert s.getblocking() is False
        assert s.getsockopt(socket.SOL_IP, IP_TRANSPARENT) == 0
        assert s.getsockname() == ("0.0.0.0", 0)
    finally:
        s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="IP_TRANSPARENT needs CAP_NET_ADMIN")
def test_transparent_upstream_socket_binds_the_client_address_without_a_port() -> None:
    # Binding a foreign address is a socket option, not a routing change.
    s = upstream_socket("198.51.100.7")
    try:
        assert s.getsockopt(socket.SOL_IP, IP_TRANSPARENT) == 1
        # IP_BIND_ADDRESS_NO_PORT: the port is chosen at connect(), per 4-tuple.
        assert s.getsockname() == ("198.51.100.7", 0)
    finally:
        s.close()


def time_wait_toward(port: int) -> int:
    listing = subprocess.run(["ss", "-Htan", "state", "time-wait", "dst", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, check=True).stdout
    return len(listing.splitlines())


@pytest.mark.skipif(os.geteuid() != 0, reason="sock_diag's destroy needs CAP_NET_ADMIN")
def test_only_time_wait_sockets_with_a_foreign_own_address_are_closed() -> None:
    """A relay's connection is bound to the client's address; a TIME_WAIT socket whose own
    address is the node's is some local program's, and stays (its endpoint is ours)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        client.close()  # the active close: the client's socket goes to TIME_WAIT
        assert conn.recv(1) == b""
        conn.close()
        assert time_wait_toward(port) == 1
        assert close_time_wait_legs(4, {("127.0.0.1", port)}) == 0
        assert time_wait_toward(port) == 1
        assert close_time_wait_legs(4, set()) == 0


class _FakeDiag:
    """pyroute2's DiagSocket over a kernel that cannot destroy sockets: one TIME_WAIT
    socket of a relay's (a client's address, toward an endpoint), every destroy refused."""

    def __init__(self) -> None:
        self.put_calls = 0

    def __enter__(self) -> _FakeDiag:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self) -> None:
        pass

    def get_sock_stats(self, **kw: object) -> list[dict[str, object]]:
        leg = {"idiag_src": "198.51.100.7", "idiag_sport": 40000, "idiag_dst": "10.244.1.11",
               "idiag_dport": 8080, "idiag_if": 0, "idiag_cookie": 1}
        return [leg, {**leg, "idiag_sport": 40001, "idiag_cookie": 2}]

    def nlm_request(self, *args: object) -> Iterator[object]:
        from pyroute2.netlink.exceptions import NetlinkError
        raise NetlinkError(errno.EOPNOTSUPP)

    def put(self, *args: object) -> None:
        self.put_calls += 1


def test_a_kernel_that_cannot_close_time_wait_sockets_is_an_error_not_a_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pyroute2.netlink.diag
    fake = _FakeDiag()
    monkeypatch.setattr(pyroute2.netlink.diag, "DiagSocket", lambda: fake)
    with pytest.raises(OSError, match="sock_diag destroy") as raised:
        close_time_wait_legs(4, {("10.244.1.11", 8080)})
    assert raised.value.errno == errno.EOPNOTSUPP
    assert fake.put_calls == 0, "nothing more is asked of a kernel that refused the first"
