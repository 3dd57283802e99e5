"""``kpx node``'s conntrack timeout flags: kube-proxy's names, defaults and units, wired through.

kube-proxy's ``--conntrack-tcp-timeout-established`` (24h) and
``--conntrack-tcp-timeout-close-wait`` (1h); 0 means "leave as is", which for
kpx is "never expire". ``serve`` must hand both to the Dataplane.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

import proxy.commands.node
import proxy.commands.wiring
from proxy.commands import node, wiring


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    node.configure(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_kube_proxys() -> None:
    args = parse()
    assert args.conntrack_tcp_timeout_established == 24 * 3600
    assert args.conntrack_tcp_timeout_close_wait == 3600


@pytest.mark.parametrize(("text", "seconds"), [
    ("24h", 86400.0), ("1h", 3600.0), ("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("0", 0.0),
    ("0s", 0.0),
])
def test_durations(text: str, seconds: float) -> None:
    args = parse("--conntrack-tcp-timeout-established", text,
                 "--conntrack-tcp-timeout-close-wait", text)
    assert args.conntrack_tcp_timeout_established == seconds
    assert args.conntrack_tcp_timeout_close_wait == seconds


@pytest.mark.parametrize("text", ["-1s", "soon", ""])
def test_bad_durations_are_refused(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--conntrack-tcp-timeout-close-wait", text)
    assert "--conntrack-tcp-timeout-close-wait" in capsys.readouterr().err


class _Built(Exception):
    """Raised by the fake Dataplane: serve() got as far as building it."""


def test_serve_passes_both_to_the_dataplane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_dataplane(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(proxy.commands.wiring, "Dataplane", fake_dataplane)
    args = parse("--state", str(tmp_path / "state.yaml"), "--no-healthz",
                 "--conntrack-tcp-timeout-established", "90s",
                 "--conntrack-tcp-timeout-close-wait", "0")
    with pytest.raises(_Built):
        asyncio.run(wiring.serve(args, None))
    assert seen["tcp_timeout_established"] == 90.0
    assert seen["tcp_timeout_close_wait"] == 0.0


# -- nfqueue mode's --queue-batch-wait ------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("100us", 1e-4), ("100µs", 1e-4), ("250ns", 2.5e-7), ("2ms", 0.002), ("0", 0.0),
])
def test_queue_batch_wait_takes_go_durations_down_to_microseconds(text: str,
                                                                  seconds: float) -> None:
    assert parse("--queue-batch-wait", text).queue_batch_wait == pytest.approx(seconds)


def test_queue_batch_wait_defaults_to_100us() -> None:
    assert parse().queue_batch_wait == pytest.approx(100e-6)


def test_a_queue_batch_wait_past_10ms_is_refused_before_anything_is_touched(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def claim(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the namespace was claimed: the flag was not refused first")

    monkeypatch.setattr(proxy.commands.node.Ownership, "acquire", claim)
    args = parse("--state", str(tmp_path / "state.yaml"), "--proxy-mode", "nfqueue",
                 "--queue-batch-wait", "50ms")
    assert node.run(args) == 2
    assert "--queue-batch-wait 0.05s: at most 10ms" in caplog.text


def test_serve_nfqueue_hands_the_batch_wait_to_the_dataplane(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_dataplane(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(proxy.commands.wiring, "NfqueueDataplane", fake_dataplane)
    monkeypatch.setattr(proxy.commands.wiring.conntrack, "apply", lambda settings: None)
    args = parse("--state", str(tmp_path / "state.yaml"), "--no-healthz",
                 "--proxy-mode", "nfqueue", "--queue-batch-wait", "250us")

    async def go() -> None:
        await wiring.serve_nfqueue(args, asyncio.get_running_loop(), wiring.StateHub(),
                                 None, None)  # type: ignore[arg-type]

    with pytest.raises(_Built):
        asyncio.run(go())
    assert seen["batch_wait"] == pytest.approx(250e-6)
