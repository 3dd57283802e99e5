"""A demo's attempt tells a dropped SYN from a connection that was accepted and not answered.

The local-drop demo's claim is "node2 dropped the SYN": a client whose connect times
out. A connection accepted and then left silent timed out too, at the read, and was
counted as a dropped SYN: the claim would have been judged held.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from lab.demos import attempt


class LoopbackLab:
    """What ``attempt`` uses of a lab: a socket "in" a namespace (here, this one)."""

    @contextlib.contextmanager
    def socket(self, src: str, family: int = socket.AF_INET,
               type: int = socket.SOCK_STREAM) -> Iterator[socket.socket]:
        with socket.socket(family, type) as s:
            yield s


def test_an_accepted_connection_that_never_answers_is_no_reply_not_a_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; no reply
        port = silent.getsockname()[1]
        assert attempt(LoopbackLab(), "client", "127.0.0.1", port, 0.3).outcome == "no reply"
    # The port is closed now: nothing listens, the kernel refuses.
    assert attempt(LoopbackLab(), "client", "127.0.0.1", port, 0.3).outcome == "refused"
