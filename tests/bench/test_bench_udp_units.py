"""The udp workload's pure pieces: the client's statistics and checks, its payloads,
the state file's UDP port, the contenders' UDP rules, flags and reporting.

No namespaces. Two tests drive ``bench.udpclient.Load`` over loopback
against an in-process echo (a thread, a few hundred datagrams, under a
second), because the loss/late/refused accounting lives in the loop itself.
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import cli, report, udpclient
from bench.contenders import (
    UDP_OFFSET,
    VIP_UDP_PORT,
    HAProxy,
    Kernel,
    Naive,
    NfqFloor,
    NfqPyFloor,
    Socat,
    bench_state,
    default_contenders,
    serves,
)
from bench.control import percentile
from bench.results import CellTable, Run, all_ratios
from bench.topology import NODE1_IP, POD1_IP, POD2_IP, SERVICE_VIP, Topology
from bench.udpclient import FlowStats, classify, payload, percentiles
from bench.workloads import Settings


def parse(*argv: str) -> argparse.Namespace:
    return cli.parse(list(argv))


# ---- statistics --------------------------------------------------------------------


def test_percentiles_agree_with_the_control_workloads_nearest_rank() -> None:
    rng = random.Random(7)
    for n in (1, 2, 3, 99, 100, 101, 1000):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        got = percentiles(xs, (50, 99, 99.9, 100))
        for p, v in got.items():
            assert v == percentile(xs, p), (n, p)
    with pytest.raises(ValueError):
        percentiles([], (50,))


def test_summary_rates_and_milliseconds() -> None:
    st = FlowStats(flows=2, size=64, latencies_ns=[1_000_000] * 98 + [5_000_000, 9_000_000],
                   seconds=2.0, sent=100, per_flow=[60, 40])
    out = st.summary()
    assert out["replies"] == 100 and out["rate"] == 50.0
    assert out["latency_ms"]["50"] == 1.0 and out["latency_ms"]["99"] == 5.0
    assert out["latency_ms"]["100"] == 9.0 and out["latency_ms"]["99.9"] == 9.0
    assert out["per_flow_min"] == 40 and out["per_flow_max"] == 60
    assert abs(out["mean_ms"] - 1.12) < 1e-9
    empty = FlowStats(flows=1, size=64).summary()
    assert empty["rate"] == 0.0 and empty["latency_ms"] == {}


def test_problems_name_every_reason_a_run_is_not_clean() -> None:
    clean = FlowStats(flows=2, size=64, latencies_ns=[1] * 1000, seconds=1.0, sent=1000,
                      lost=1, per_flow=[500, 500])
    assert clean.problems(0.001) == []  # 1 in 1,000 is allowed
    lossy = FlowStats(flows=2, size=64, latencies_ns=[1] * 1000, seconds=1.0, sent=1000,
                      lost=2, per_flow=[500, 500])
    (why,) = lossy.problems(0.001)
    assert "2 of 1000 requests unanswered" in why and "0.1% allowed" in why
    corrupt = FlowStats(flows=1, size=64, latencies_ns=[1], seconds=1.0, sent=1, corrupt=3,
                        per_flow=[1])
    assert corrupt.problems(0.001) == ["3 corrupt replies (not the request's bytes)"]
    starved = FlowStats(flows=3, size=64, latencies_ns=[1] * 10, seconds=1.0, sent=10,
                        per_flow=[5, 5, 0])
    assert starved.problems(0.5) == ["1 flows got no reply in the measured window"]
    dead = FlowStats(flows=50, size=64, error="50 of 50 flows got no reply within 5s (...)")
    assert dead.problems(0.001) == ["50 of 50 flows got no reply within 5s (...)"]
    silent = FlowStats(flows=1, size=64, seconds=1.0)
    assert silent.problems(0.001) == ["no reply in the measured window"]


def test_payloads_stay_on_lab_echos_plain_echo_path() -> None:
    from lab.echo import EchoServer, udp_reply

    server = EchoServer("p", "n")
    for flow, seq in ((0, 1), (49, 2**32 + 5), (999, 7)):
        data = payload(flow, seq, 64)
        assert len(data) == 64 and not data.startswith((b"WHO", b"ECHO "))
        assert udp_reply(server, data, ("10.0.0.1", 1)) == data
    assert len(payload(1, 1, udpclient.MIN_SIZE)) == udpclient.MIN_SIZE


def test_classify_tells_late_from_corrupt() -> None:
    cur = payload(3, 10, 64)
    assert classify(cur, cur) == "ok"
    assert classify(payload(3, 9, 64), cur) == "late"
    assert classify(payload(3, 11, 64), cur) == "corrupt"  # from the future
    assert classify(payload(4, 9, 64), cur) == "corrupt"  # another flow's
    assert classify(cur[:-1] + b"x", cur) == "corrupt"
    assert classify(b"", cur) == "corrupt"


def test_load_refuses_bad_sizes_and_flow_counts() -> None:
    with pytest.raises(ValueError):
        udpclient.Load("127.0.0.1", 9, 0, 64, 1.0)
    with pytest.raises(ValueError):
        udpclient.Load("127.0.0.1", 9, 1, udpclient.MIN_SIZE - 1, 1.0)


# ---- the loop, over loopback --------------------------------------------------------


@pytest.fixture
def lossy_echo() -> Iterator[int]:
    """An echo on 127.0.0.1 that drops seq % 20 == 7 and answers seq % 20 == 13 twice
    (the second copy arrives when the flow has moved on: a late reply)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, addr = sock.recvfrom(2048)
            except TimeoutError:
                continue
            seq = udpclient.HEADER.unpack_from(data)[2] if len(data) >= 10 else 0
            if seq % 20 == 7:
                continue
            sock.sendto(data, addr)
            if seq % 20 == 13:
                sock.sendto(data, addr)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=2)
        sock.close()


@pytest.mark.timeout(20)
def test_loop_counts_lost_and_late_and_keeps_going(lossy_echo: int) -> None:
    load = udpclient.Load("127.0.0.1", lossy_echo, 3, 64, timeout=0.05)
    try:
        assert load.warmup(2.0, 0.05)
        load.run(seconds=0.6, max_requests=600)
    finally:
        load.close()
    st = load.stats
    assert st.error is None and st.corrupt == 0
    assert st.lost >= 3 and st.late >= 3
    assert len(st.latencies_ns) > 30 and min(st.per_flow) > 0
    assert st.sent <= 600 + 3  # the count bound holds (plus the flows' first requests)
    assert st.problems(0.5) == [] and st.problems(0.001)  # loss is judged, not hidden


@pytest.mark.timeout(20)
def test_nothing_listening_is_an_error_in_bounded_time() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing is bound there
    load = udpclient.Load("127.0.0.1", port, 4, 64, timeout=0.1)
    try:
        assert not load.warmup(0.3, 0.05)
    finally:
        load.close()
    st = load.stats
    assert st.error and "4 of 4 flows got no reply within 0.3s" in st.error
    assert "ICMP port unreachable" in st.error and st.warmup_s < 1.0


# ---- state file, contenders, flags, report -----------------------------------------


def test_udp_port_in_the_state_is_kubernetes_shaped() -> None:
    k8s = pytest.importorskip("proxy.k8s")
    snap = k8s.parse_state(bench_state("local", 30400, 30401, udp_node_port=30404))
    (svc,) = snap.services
    udp = [p for p in svc.ports if p.protocol == "UDP"]
    assert [(p.name, p.port, p.node_port) for p in udp] == [("echo-udp", VIP_UDP_PORT, 30404)]
    assert str(udp[0].target_port) == "5353"
    (sl,) = snap.slices_for(svc)
    assert {(p.name, p.port, p.protocol) for p in sl.ports} >= {("echo-udp", 5353, "UDP")}
    tcp_only = bench_state("local", 30400, 30401)
    assert "UDP" not in tcp_only  # TCP workloads: the state kpx had before udp


def test_kernel_dnats_udp_like_tcp(tmp_path: Path) -> None:
    topo = Topology(prefix="kbtest-")
    k = Kernel(topo, tmp_path)
    assert k.target().udp_port == k.port_base + UDP_OFFSET
    assert (f"ip daddr {NODE1_IP} udp dport {k.port_base + UDP_OFFSET} dnat to "
            f"{POD1_IP}:5353") in k.ruleset()
    k.path = "clusterip"
    assert f"ip daddr {SERVICE_VIP} udp dport 53 dnat to {POD2_IP}:5353" in k.ruleset()


def test_socat_and_naive_relay_udp_to_the_pod(tmp_path: Path) -> None:
    topo = Topology(prefix="kbtest-")
    s = Socat(topo, tmp_path)
    argv = s.argv()
    assert argv[0] == "socat" and "-T" in argv
    assert argv[-2] == f"UDP4-LISTEN:{s.port_base + UDP_OFFSET},bind={NODE1_IP},fork,reuseaddr"
    assert argv[-1] == f"UDP4:{POD1_IP}:5353"
    s.path = "cross"
    assert s.argv()[-1] == f"UDP4:{POD2_IP}:5353"
    assert Naive.serves("udp") is None


def test_who_takes_part_in_which_workload() -> None:
    assert serves("haproxy", "udp") and "no UDP" in (serves("haproxy", "udp") or "")
    assert serves("socat", "rr") == "socat forwards UDP only"
    assert serves("socat", "mem") == "socat forwards UDP only"
    assert serves("kernel", "mem") == "no proxy process: forwarding happens in the kernel"
    for c in ("direct", "kernel", "naive", "socat", "kpx", "kpx-w2"):
        assert serves(c, "udp") is None, c
    assert HAProxy.serves("rr") is None


def test_udp_is_opt_in_and_brings_socat() -> None:
    cfg = cli.build_config(parse())
    assert "udp" not in cfg.workloads and "socat" not in cfg.contenders
    assert default_contenders(cfg.workloads) == cfg.contenders
    cfg = cli.build_config(parse("--workloads", "udp", "--quick"))
    assert cfg.workloads == ["udp"]
    assert cfg.contenders == ["direct", "kernel", "haproxy", "naive", "socat", "kpx", "kpx-w2",
                              "kpx-nfq"]
    assert cfg.settings.duration("udp") == 3.0  # rr's length, quick
    cfg = cli.build_config(parse("--workloads", "rr,udp", "--duration", "2"))
    assert cfg.settings.duration("udp") == 2.0 and cfg.settings.duration("rr") == 2.0
    assert Settings(durations={"rr": 4.0, "udp": 2.0}).duration("udp") == 2.0
    s = Settings()
    assert (s.udp_flows, s.udp_size) == (50, 64)


def test_the_nfqueue_floor_runs_only_when_named_and_only_where_it_can() -> None:
    """A diagnostic (issue 15): never in a default run, where a C program would be built;
    IPv4 NodePorts only, and TCP only."""
    assert "nfq-floor" not in cli.build_config(parse()).contenders
    assert "nfq-floor" not in cli.build_config(parse("--workloads", "udp")).contenders
    cfg = cli.build_config(parse("--contenders", "kernel,kpx-nfq,nfq-floor"))
    assert cfg.contenders == ["kernel", "kpx-nfq", "nfq-floor"]
    assert NfqFloor.serves_path("local", 4) is None and NfqFloor.serves_path("cross", 4) is None
    assert "IPv4 NodePort" in (NfqFloor.serves_path("clusterip", 4) or "")
    assert "IPv4 NodePort" in (NfqFloor.serves_path("local", 6) or "")
    assert serves("nfq-floor", "cps") is None and serves("nfq-floor", "connect") is None
    assert serves("nfq-floor", "udp") and serves("nfq-floor", "mem")
    assert "nfq-pyfloor" not in cli.build_config(parse()).contenders
    assert serves("nfq-pyfloor", "connect") is None and serves("nfq-pyfloor", "udp")
    assert NfqPyFloor.serves_path("cross", 4) is None
    assert NfqPyFloor.serves_path("local", 6)


def test_the_relay_floor_runs_only_when_named_and_forwards_tcp_only() -> None:
    """A diagnostic (issue 15): never in a default run, where a C program would be built;
    every TCP workload on every path, no UDP."""
    assert "relay-floor" not in cli.build_config(parse()).contenders
    assert "relay-floor" not in cli.build_config(parse("--workloads", "udp")).contenders
    cfg = cli.build_config(parse("--contenders", "haproxy,kpx,relay-floor"))
    assert cfg.contenders == ["haproxy", "kpx", "relay-floor"]
    assert all(serves("relay-floor", w, p, f) is None for w in ("bulk", "rr", "cps", "mem")
               for p, f in (("local", 4), ("cross", 4), ("clusterip", 4), ("cross", 6)))
    assert "TCP relay only" in (serves("relay-floor", "udp") or "")


def test_report_rows_and_ratios_for_udp() -> None:
    t = CellTable()
    for name, rate, p99 in (("kernel", 140000.0, 0.9), ("socat", 40000.0, 2.8),
                            ("naive", 60000.0, 1.6), ("kpx", 58000.0, 1.7)):
        t.cell("local", "udp", name).add(Run(True, {"udp_per_s": rate, "udp_p50_ms": 0.7,
                                                    "udp_p99_ms": p99}))
    t.mark("local", "udp", "haproxy", "n/a", "HAProxy has no UDP proxying")
    ratios = {(r.name, r.metric): r for r in all_ratios(t)}
    assert ratios[("kpx/socat", "udp_per_s")].value == pytest.approx(1.45)
    assert ratios[("kpx/kernel", "udp_p99_ms")].value == pytest.approx(1.7 / 0.9)
    assert ratios[("kpx/naive", "udp_per_s")].value == pytest.approx(58 / 60)
    assert not any(r.name == "kpx/haproxy" for r in ratios.values())
    text = report.summary_table(t)
    assert "udp request/response datagrams/s" in text and "N/A" in text
    line = report.run_line("local", "udp", "kpx", 0, 1, True,
                           {"udp_per_s": 58000.0, "udp_p50_ms": 0.7, "udp_p99_ms": 1.7}, None)
    assert "58,000 req/s" in line and "p50 0.7 ms" in line and "p99 1.70 ms" in line
