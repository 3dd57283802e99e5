"""The transparent-mode pieces that need no namespace: ruleset text, sockets.

Installing and removing the routing is tested only inside a test namespace
(test_dp_netns.py); nothing here changes any routing or firewall state.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess

import pytest

from proxy.userspace import transparent
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


def _leg(sport: int, cookie: int) -> bytes:
    """A relay's TIME_WAIT socket as sock_diag dumps it: a client's address toward an
    endpoint (``inet_diag_msg`` after its netlink header)."""
    sockid = (struct.pack("!HH16s16s", sport, 8080, socket.inet_aton("198.51.100.7"),
                          socket.inet_aton("10.244.1.11")) + struct.pack("=IQ", 0, cookie))
    body = struct.pack("=BBxx", socket.AF_INET, 6) + sockid + b"\0" * 20
    return struct.pack("=IHHII", 16 + len(body), 20, 2, 1, 0) + body


class _FakeDiag:
    """A NETLINK_SOCK_DIAG socket: two TIME_WAIT legs of a relay's, then each destroy
    answered with ``answer`` (an errno; 0: done)."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.sent: list[bytes] = []
        self.replies = [_leg(40000, 1) + _leg(40001, 2)
                        + struct.pack("=IHHIIi", 20, 3, 2, 1, 0, 0)]  # NLMSG_DONE

    def __enter__(self) -> _FakeDiag:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        if struct.unpack_from("=H", data, 4)[0] == 21 and struct.unpack_from("=H", data, 6)[0] & 4:
            self.replies.append(struct.pack("=IHHIIi", 36, 2, 0, 0, 0, -self.answer)
                                + data[:16])  # NLMSG_ERROR: the errno, the request's header
        return len(data)

    def recv_into(self, buf: bytearray) -> int:
        data = self.replies.pop(0)
        buf[:len(data)] = data
        return len(data)

    def recv(self, size: int) -> bytes:
        return self.replies.pop(0)

    def destroys(self) -> list[bytes]:
        """The socket ids asked to be destroyed, in order."""
        return [d[16 + 8:] for d in self.sent if struct.unpack_from("=H", d, 4)[0] == 21]


def test_a_relays_time_wait_legs_are_destroyed_by_the_ids_the_dump_gave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDiag(0)
    monkeypatch.setattr(transparent, "_diag_socket", lambda: fake)
    assert close_time_wait_legs(4, {("10.244.1.11", 8080)}) == 2
    assert fake.destroys() == [_leg(40000, 1)[20:68], _leg(40001, 2)[20:68]]
    other = _FakeDiag(0)
    monkeypatch.setattr(transparent, "_diag_socket", lambda: other)
    assert close_time_wait_legs(4, {("10.244.1.12", 8080)}) == 0, "another endpoint's legs stay"
    assert other.destroys() == []


def test_a_kernel_that_cannot_close_time_wait_sockets_is_an_error_not_a_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDiag(errno.EOPNOTSUPP)
    monkeypatch.setattr(transparent, "_diag_socket", lambda: fake)
    with pytest.raises(OSError, match="sock_diag destroy") as raised:
        close_time_wait_legs(4, {("10.244.1.11", 8080)})
    assert raised.value.errno == errno.EOPNOTSUPP
    assert len(fake.destroys()) == 1, "nothing more is asked of a kernel that refused the first"
