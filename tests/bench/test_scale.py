"""The scale bench: its pure parts, and a few-second run at tiny N.

The run is a smoke test of the plumbing (namespaces, backends, every
contender's load and change, the checks, the JSON and the PNG), not a
measurement: 30 services, 40 connections.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bench import scale
from bench.results import validate


def test_every_contender_dials_the_same_services_in_the_same_order() -> None:
    assert scale.spread(30000, 500, 16) == scale.spread(30000, 500, 16)
    assert scale.spread(30000, 500, 16) != scale.spread(10000, 500, 16)
    assert all(0 <= i < 1000 for i in scale.spread(1000, 2000, 16))


def test_services_have_three_distinct_answerable_endpoints_and_unique_addresses() -> None:
    svcs = scale.services(30000)
    assert len({s.cluster_ip for s in svcs}) == 30000
    assert len({s.node_port for s in svcs}) == 30000
    eps = [e.ip for s in svcs for e in s.endpoints]
    assert len(set(eps)) == 90000
    assert all(ip.split(".")[1] in ("128", "129", "130") for ip in eps)  # the pods' local /16s
    moved = scale.services(30000, moved=29999)[-1]
    assert moved.endpoints[2].ip not in eps and moved.endpoints[2].ip.startswith("10.130.")


def test_kpx_gets_the_same_services_as_yaml() -> None:
    text = scale.kpx_state(scale.services(2))
    assert text.count("kind: Service\n") == 2 and text.count("kind: EndpointSlice") == 2
    assert "clusterIP: 10.96.0.11" in text and "nodePort: 20001" in text
    assert "- 10.129.0.1" in text


def test_kpx_log_lines_give_generations_and_refusals() -> None:
    log = ("x INFO service VIPs in force (generation 2): 400 VIPs\n"
           "x INFO nfqueue rules in force (generation 5): 1 ports\n"
           "x ERROR nfqueue: generation 6 not put in force: too many endpoints; the last stays\n")
    assert scale.generations(log) == [2, 5]
    assert "generation 6 not put in force: too many endpoints" in (scale.refusal(log) or "")
    assert scale.refusal("all good\n") is None


def test_meminfo_sums_only_the_kernel_object_pools() -> None:
    got = scale.read_meminfo("MemFree: 5 kB\nSlab:  100 kB\nVmallocUsed: 20 kB\nPercpu: 3 kB\n")
    assert got == {"Slab": 100, "VmallocUsed": 20, "Percpu": 3}


def test_the_latency_summary_is_nearest_rank() -> None:
    s = scale.summarize_ms([float(i) for i in range(1, 101)])
    assert (s["lat_p50_ms"], s["lat_p90_ms"], s["lat_p99_ms"]) == (50.0, 90.0, 99.0)


def test_ipvs_says_why_not_on_this_kernel() -> None:
    why = scale.ipvs_unavailable()
    assert (why is None) == Path("/proc/net/ip_vs").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft")
                    or not shutil.which("iptables-legacy-restore"),
                    reason="needs root, nft and iptables")
def test_a_tiny_scale_run_measures_every_contender_or_says_why(tmp_path: Path) -> None:
    kpx = shutil.which("kpx") or str(Path(os.sys.executable).parent / "kpx")
    cfg = scale.ScaleConfig(sizes=(30,), connections=40, rate_seconds=0.3, out=tmp_path,
                            kpx=kpx, kpx_timeout=30.0)
    bench = scale.ScaleBench(cfg, stream=open(os.devnull, "w"))  # noqa: SIM115
    assert bench.run() == 0
    doc = json.loads(bench.result_path.read_text())
    assert validate(doc) == []
    cells = {c["contender"]: c for c in doc["cells"]}
    assert cells["ipvs"]["status"] in ("unavailable", "ok")
    for name in ("iptables-nft", "iptables-legacy", "nftables", "kpx", "kpx-nfq"):
        assert cells[name]["status"] == "ok", (name, cells[name]["reason"])
        m = cells[name]["runs"][0]["metrics"]
        assert 0 < m["lat_p50_ms"] <= m["lat_p99_ms"] < 1000 and m["cps"] > 0
        assert m["program_s"] > 0 and m["change_s"] > 0
    assert Path(doc["charts"][0]).exists()
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith(bench.net.prefix)]


def test_the_check_names_an_answer_from_outside_the_service(unused_tcp_port: int) -> None:
    """The planted fault: a service whose endpoints do not include the answering address."""
    import threading

    from bench import scaleprobe

    threading.Thread(target=scaleprobe.serve, args=(unused_tcp_port,), daemon=True).start()
    import time

    from lab.common import poll

    def up() -> bool:
        try:
            return scaleprobe.answered_by("127.0.0.1", unused_tcp_port, 0.5) == "127.0.0.1"
        except OSError:
            time.sleep(0.02)
            return False

    assert poll(up, 5.0)
    good = scaleprobe.check([{"ip": "127.0.0.1", "endpoints": ["127.0.0.1"]}], unused_tcp_port,
                            1.0)
    bad = scaleprobe.check([{"ip": "127.0.0.1", "endpoints": ["127.0.0.2", "127.0.0.3"]}],
                           unused_tcp_port, 1.0)
    assert good == [] and len(bad) == 1 and "answered from 127.0.0.1" in bad[0]
