"""Send pure SYNs with scapy and classify each answer: synack, rst or none.

Usage: ``python dp_probe.py TIMEOUT DST:PORT...`` (run inside a namespace);
prints one word per target.
This is the on-wire proof the issue asks for: a dropped SYN gets *no* answer
at all, not an RST, and a rejected one gets an RST at once.
"""

from __future__ import annotations

import random
import sys

from scapy.all import IP, TCP, conf, sr1  # type: ignore[attr-defined]


def probe(dst: str, port: int, timeout: float) -> str:
    ans = sr1(IP(dst=dst) / TCP(sport=random.randint(40000, 60000), dport=port,
                                flags="S", seq=1000), timeout=timeout)
    if ans is None or TCP not in ans:
        return "none"
    if ans[TCP].flags & 0x04:
        return "rst"
    if ans[TCP].flags & 0x12 == 0x12:
        return "synack"
    return f"other:{ans[TCP].flags}"


def main() -> None:
    timeout = float(sys.argv[1])
    conf.verb = 0
    out = []
    for target in sys.argv[2:]:
        dst, port = target.rsplit(":", 1)
        out.append(probe(dst, int(port), timeout))
    print(" ".join(out))

if __name__ == "__main__":
    main()
