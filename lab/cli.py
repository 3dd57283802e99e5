"""``kpx lab``: drive a multi-node namespace lab from the shell.

Owns: the command line of the lab (``up``, ``down``, ``status``, ``exec``,
``apply``, ``delete-pod``, ``logs``, ``lb-address``) and how it prints.

Never: keep state in memory between invocations or do lab work itself.
Every command finds the lab through its run directory
(``$KPX_RUN_DIR/<name>``, default ``/run/kpx/<name>``) and its ``lab.json``,
and calls ``lab.cluster``; ``up`` leaves its processes running in their own
sessions and exits, so the lab outlives the command that made it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.cluster import DEFAULT_NAME, PREFIX_RE, RUN_DIR_ENV, Lab, LabError, default_run_dir
from lab.mirror import DEFAULT_MAX_NODES, DEFAULT_MAX_PODS

_USE_COLOR = sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _c(text: str, code: str) -> str:
    return f"\033[{code}m{text}\033[0m" if _USE_COLOR else text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Build and drive a multi-node kube-proxy lab in network namespaces. "
        f"Labs live in ${RUN_DIR_ENV}/<name> (default /run/kpx/<name>).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=DEFAULT_NAME,
                        help=f"lab name, also its namespace prefix (default {DEFAULT_NAME})")
    sub = parser.add_subparsers(dest="lab_command", metavar="COMMAND", required=True)

    p = sub.add_parser("up", parents=[common], help="build a lab (tears down an old one)")
    p.add_argument("lab", nargs="?", help="lab YAML file (default: the built-in 3-node lab)")
    p.add_argument("--from-state", metavar="STATE", type=Path,
                   help="mirror a cluster: a state file (kpx snapshot, or kubectl get"
                        " nodes,svc,endpointslices -A -o yaml) instead of a lab file")
    p.add_argument("--max-nodes", type=_positive, default=DEFAULT_MAX_NODES, metavar="N",
                   help=f"--from-state: at most N nodes (default {DEFAULT_MAX_NODES})")
    p.add_argument("--max-pods", type=_positive, default=DEFAULT_MAX_PODS, metavar="N",
                   help=f"--from-state: at most N pods (default {DEFAULT_MAX_PODS})")
    p.add_argument("--dual-stack", action="store_true",
                   help="give every node, pod, the client and the LB a ULA IPv6 address"
                        " (fd00::/8) too; services that name no IP family become"
                        " PreferDualStack")
    p.add_argument("--no-proxies", action="store_true", help="do not start kpx node")
    p.add_argument("--no-lb", action="store_true", help="do not start the load balancer")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every kpx node (repeatable; write flags as"
                        " --proxy-arg=--masquerade-all)")

    sub.add_parser("down", parents=[common], help="remove the lab, even after a crash")

    p = sub.add_parser("status", parents=[common], help="live state of every node")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("exec", parents=[common],
                       help="run a command in a lab namespace: exec NODE|client|lb|POD -- CMD")
    p.add_argument("target", help="a node name, a pod name, client, lb or sw")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...",
                   help="the command to run, after --")

    p = sub.add_parser("apply", parents=[common], help="converge the running lab on a lab file")
    p.add_argument("lab", help="lab YAML file")

    p = sub.add_parser("delete-pod", parents=[common],
                       help="delete a pod gracefully (terminating for --grace seconds)")
    p.add_argument("pod")
    p.add_argument("--grace", type=float, default=30.0, help="grace period (default 30 s)")
    p.add_argument("--no-wait", action="store_true",
                   help="return at once; a background process finishes the deletion")

    p = sub.add_parser("logs", parents=[common], help="show a node's kpx node log (or a pod's)")
    p.add_argument("target", help="node name, pod name, or lb")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", "--lines", type=int, default=0, help="only the last N lines")

    sub.add_parser("lb-address", parents=[common],
                   help="ip:port where the client reaches the LB-fronted service")


def run(args: argparse.Namespace) -> int:
    handler = {
        "up": _up, "down": _down, "status": _status, "exec": _exec, "apply": _apply,
        "delete-pod": _delete_pod, "logs": _logs, "lb-address": _lb_address,
    }[args.lab_command]
    if not PREFIX_RE.match(args.name):
        # The name prefixes every namespace; a '-' in it could match another lab's.
        print(f"kpx lab: bad --name {args.name!r}: a lowercase letter, then up to 15"
              " lowercase letters or digits", file=sys.stderr)
        return 2
    if os.geteuid() != 0 and args.lab_command not in ("logs",):
        print("kpx lab: needs root (network namespaces)", file=sys.stderr)
        return 1
    from lab.common import interrupt_on_termination

    interrupt_on_termination()
    try:
        return handler(args)
    except LabError as exc:
        print(f"kpx lab: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # LabSpecError and bad names
        print(f"kpx lab: {exc}", file=sys.stderr)
        return 2


def _run_dir(args: argparse.Namespace) -> Path:
    return default_run_dir(args.name)


def _attach(args: argparse.Namespace) -> Lab:
    return Lab.attach(_run_dir(args))


def _attach_to_read(args: argparse.Namespace) -> Lab:
    """The lab for a command that reads only its topology, names and addresses (status,
    exec): a recorded ``loadBalancer`` section this kpx refuses is left out, and said so."""
    lab = Lab.attach(_run_dir(args), lenient=True)
    for problem in lab.refused:
        print(f"kpx lab {args.lab_command}: the recorded load balancer settings are refused"
              f" and left out: {problem}", file=sys.stderr)
    return lab


PROXY_MODULES = ("proxy.commands.node", "proxy.commands.wiring")
"""What ``kpx node`` needs importable: its flags and claim, then the wiring of source, hub,
proxier and dataplane (CONTRACTS.md)."""


def proxies_available() -> tuple[bool, str]:
    """Whether ``kpx node`` can start here, checked in a child so nothing leaks into us.

    ``proxy.commands.node`` imports the rest of kpx only once it has claimed the
    namespace, so importing it alone proves little; ``proxy.commands.wiring`` imports
    the dataplane.
    """
    code = "; ".join(f"import {m}" for m in PROXY_MODULES)
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode == 0:
        return True, ""
    last = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
    return False, last


# --- commands ----------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _up(args: argparse.Namespace) -> int:
    from lab.spec import LabSpec

    if args.from_state is not None:
        if args.lab:
            print("kpx lab up: give a lab file or --from-state, not both", file=sys.stderr)
            return 2
        spec = _mirror(args.from_state, args.max_nodes, args.max_pods)
    else:
        spec = LabSpec.load(args.lab) if args.lab else LabSpec.default()
    start_proxies = not args.no_proxies
    if start_proxies:
        ok, why = proxies_available()
        if not ok:
            print(f"kpx lab: kpx node cannot start ({why}); lab comes up without proxies",
                  file=sys.stderr)
            start_proxies = False
    lab = Lab(spec, prefix=args.name, run_dir=_run_dir(args), start_proxies=start_proxies,
              extra_proxy_args=args.proxy_arg, start_lb=not args.no_lb,
              dual_stack=args.dual_stack)
    lab.up()
    _print_table(lab)
    return 0


def _mirror(path: Path, max_nodes: int, max_pods: int) -> Any:
    """The lab that mirrors the cluster in *path*; says what it leaves out, and why."""
    from lab.mirror import load_documents, translate
    from lab.spec import MAX_NODES, LabSpec

    if max_nodes > MAX_NODES:
        raise ValueError(f"--max-nodes: the lab holds at most {MAX_NODES} nodes")
    mirror = translate(load_documents(path), max_nodes, max_pods, str(path))
    print(f"{path}: mirroring {mirror.summary()}")
    if mirror.left_out:
        print(f"left out ({len(mirror.left_out)}):")
        for item in mirror.left_out:
            print(f"  {item}")
    print(flush=True)
    if not mirror.spec["nodes"]:
        raise ValueError(f"{path}: no Node left to build a lab of")
    return LabSpec.from_dict(mirror.spec, f"{path} (as a lab)")


def _print_table(lab: Lab) -> None:
    print(_c(f"lab {lab.prefix} is up", "1;32") + f" in {lab.up_seconds or 0:.1f}s"
          f"  (run dir {lab.run_dir})")
    print()
    rows = [("NODE", "NAMESPACE", "IP", "POD CIDR", "KPX NODE")]
    for n in lab.nodes:
        pid = lab.proxy_pid(n)
        rows.append((n, lab.ns(n), _ips(lab, lambda f, n=n: lab.node_ip(n, f)),
                     ",".join(x for x in (lab.pod_cidr(n), lab.pod_cidr(n, 6)) if x != "-")
                     or "-", f"pid {pid}" if pid else "not started"))
    rows.append(("client", lab.ns("client"), _ips(lab, lab.client_ip), "-", "-"))
    rows.append(("lb", lab.ns("lb"), f"{_ips(lab, lab.lb_ip)}, {_ips(lab, lab.lb_front_ip)}",
                 "-", "-"))
    _table(rows)
    print()
    rows = [("POD", "NODE", "IP", "PORT", "LABELS")]
    for p in lab.pods:
        spec = lab.pod_info(p)
        rows.append((p, spec["node"], ",".join(filter(None, (spec["ip"], spec["ip6"]))),
                     str(spec["port"]),
                     ",".join(f"{k}={v}" for k, v in spec["labels"].items())))
    _table(rows)
    print()
    rows = [("SERVICE", "TYPE", "eTP", "CLUSTER-IP", "EXTERNAL-IP", "PORT -> TARGET", "NODEPORT",
             "HC PORT")]
    for key in lab.services:
        spec = lab.service(key)["spec"]
        ports = spec.get("ports", [])
        rows.append((key, spec["type"], spec.get("externalTrafficPolicy", "-"),
                     ",".join(spec.get("clusterIPs") or []) or spec.get("clusterIP") or "-",
                     _external_text(spec["type"], lab.external_ips(key), lab.ingress(key)),
                     ",".join(f"{p['port']}->{p.get('targetPort')}" for p in ports),
                     ",".join(str(p.get("nodePort", "-")) for p in ports),
                     str(spec.get("healthCheckNodePort") or "-")))
    _table(rows)
    print()
    with contextlib.suppress(LabError, KeyError):
        ip, port = lab.lb_address()
        print(f"reach it:  kpx lab exec client -- curl -s http://{ip}:{port}/")
    print(f"see it:    kpx lab status{_name_flag(lab)}   |   remove it: kpx lab down"
          f"{_name_flag(lab)}")


def _ips(lab: Lab, of: Any) -> str:
    """``of(4)``, and ``of(6)`` after a comma in a dual-stack lab."""
    return f"{of(4)},{of(6)}" if lab.dual_stack else str(of(4))


def _external_text(svc_type: str, external_ips: list[str],
                   ingress: list[dict[str, Any]]) -> str:
    """kubectl's EXTERNAL-IP column, with each ingress IP's ipMode: ``10.79.0.1 (VIP)``."""
    shown = [f"{i.get('ip')} ({i.get('ipMode', 'VIP')})" for i in ingress]
    if svc_type == "LoadBalancer" and not shown:
        shown = ["<pending>"]
    return ",".join(shown + external_ips) or "-"


def _name_flag(lab: Lab) -> str:
    return "" if lab.prefix == DEFAULT_NAME else f" --name {lab.prefix}"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        line = "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        print(_c(line, "1") if n == 0 else line)


def _down(args: argparse.Namespace) -> int:
    from lab.cluster import teardown_by_name

    removed = teardown_by_name(args.name, _run_dir(args))
    print(f"lab {args.name}: removed {len(removed)} namespace(s)" if removed
          else f"lab {args.name}: nothing to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    lab = _attach_to_read(args)
    st = lab.status()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    print(_c(f"lab {st['name']}", "1") + f"  run dir {st['run_dir']}  state {st['state']}")
    print()
    rows = [("NODE", "IP", *(("IPV6",) if st.get("dualStack") else ()), "KPX NODE", "HEALTHZ",
             "LISTENING")]
    for n in st["nodes"]:
        proxy = n["proxy"]
        alive = (_c("running", "32") + f" (pid {proxy['pid']})" if proxy["alive"] else
                 _c("dead", "31") if proxy["pid"] else "not started")
        rows.append((n["name"], n["ip"], *((n["ip6"],) if st.get("dualStack") else ()), alive,
                     _health_text(n.get("healthz")), " ".join(n["listen"]) or "-"))
    _table(rows)
    if st["services"]:
        print()
        _table(_service_rows(st["services"]))
    hc = [(n["name"], k, v) for n in st["nodes"] for k, v in n["services"].items()]
    if hc:
        print()
        rows = [("SERVICE", "NODE", "HC PORT", "ANSWER", "LOCAL ENDPOINTS")]
        for node, key, v in hc:
            rows.append((key, node, str(v["hcPort"]), _health_text(v),
                         str(v.get("localEndpoints", "-"))))
        _table(rows)
    print()
    rows = [("POD", "NODE", "IP", "READY", "STATE")]
    for p in st["pods"]:
        state = (f"terminating ({p['deleteIn']}s left)" if p["terminating"] else "running")
        if not p["alive"]:
            state = _c("process dead", "31")
        rows.append((p["name"], p["node"], ",".join(filter(None, (p["ip"], p.get("ip6")))),
                     str(p["ready"]).lower(), state))
    _table(rows)
    print()
    # The load balancer's per-node probe results, as lab.lb.control.status() reports them.
    lb = st.get("loadBalancer")
    if lab.refused:
        print("load balancer: left out, its recorded settings are refused: "
              + "; ".join(lab.refused))
    elif lab.spec.load_balancer is None:
        print("load balancer: none in this lab")
    elif not lb:
        print("load balancer: not running (no probe results)")
    elif isinstance(lb, dict):
        print(f"load balancer: {json.dumps(lb)}")
    else:
        print(_c("load balancer probes", "1") + f" ({lab.spec.load_balancer.get('mode')},"
              f" {_probe_text(lab, lab.spec.load_balancer)})")
        rows = [("NODE", "IP", "HEALTHY", "STATE", "LAST RESULT", "SINCE")]
        for r in [*lb, *(st.get("loadBalancer6") or [])]:
            rows.append((str(r.get("name", "?")), str(r.get("ip", "")),
                         _c("yes", "32") if r.get("healthy") else _c("no", "31"),
                         str(r.get("state", "")), str(r.get("result", "")),
                         str(r.get("since", ""))))
        _table(rows)
    return 0


def _service_rows(services: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Each service's VIPs, as ``lab.status()`` reports them."""
    rows = [("SERVICE", "TYPE", "iTP", "eTP", "CLUSTER-IP", "EXTERNAL-IPS (-> NODE)",
             "LB INGRESS (ipMode)", "PORTS")]
    for s in services:
        rows.append((s["key"], s["type"], s.get("internalTrafficPolicy") or "-",
                     s.get("externalTrafficPolicy") or "-",
                     ",".join(s.get("clusterIPs") or []) or s.get("clusterIP") or "-",
                     ",".join(f"{e['ip']} -> {e['node']}" for e in s["externalIPs"]) or "-",
                     _external_text(s["type"], [], s["ingress"]),
                     ",".join(f"{p['port']}" + (f":{p['nodePort']}" if p["nodePort"] else "")
                              for p in s["ports"]) or "-"))
    return rows


def _probe_text(lab: Lab, lb: dict[str, Any]) -> str:
    """``HTTP GET :32080/healthz (healthCheckNodePort)``: the probe with its port resolved."""
    p = lb.get("probe", {})
    port = p.get("port")
    number: Any = port
    with contextlib.suppress(KeyError, IndexError):
        if port == "healthCheckNodePort":
            number = lab.hc_port(lb["service"]) or 10256
        elif port == "nodePort":
            number = lab.node_port(lb["service"])
    named = f" ({port})" if number != port else ""
    if p.get("type") == "http":
        return f"HTTP GET :{number}{p.get('path', '')}{named}"
    return f"TCP connect :{number}{named}"


def _health_text(v: dict[str, Any] | None) -> str:
    if not v:
        return "-"
    if "error" in v:
        return _c(v["error"], "31")
    code = v["status"]
    return _c(str(code), "32" if code == 200 else "31")


def _exec(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    # argparse drops the ``--`` right after TARGET, so a ``--`` still in *cmd* is either
    # the command's own argument (``exec node1 -- grep -- -x f``) or ends options given
    # after TARGET (``exec client --name x -- ...``): only the latter starts with them.
    if cmd and (cmd[0] in ("--", "--name") or cmd[0].startswith("--name=")) and "--" in cmd:
        i = cmd.index("--")
        extra = argparse.ArgumentParser(prog="kpx lab exec", add_help=False)
        extra.add_argument("--name", default=args.name)
        args.name = extra.parse_args(cmd[:i]).name
        if not PREFIX_RE.match(args.name):
            print(f"kpx lab exec: bad --name {args.name!r}", file=sys.stderr)
            return 2
        cmd = cmd[i + 1:]
    if not cmd:
        print("kpx lab exec: no command (usage: kpx lab exec TARGET -- CMD...)", file=sys.stderr)
        return 2
    lab = _attach_to_read(args)
    try:
        ns = lab.ns(args.target)
    except KeyError as exc:
        print(f"kpx lab exec: {exc.args[0]}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvp("ip", ["ip", "netns", "exec", ns, *cmd])
    return 127  # pragma: no cover - execvp does not return


def _apply(args: argparse.Namespace) -> int:
    lab = _attach(args)
    changes = lab.apply(args.lab)
    words = [f"{k} {', '.join(v)}" for k, v in changes.items() if v]
    print(f"lab {lab.prefix}: " + ("; ".join(words) if words else "no changes"))
    return 0


def _delete_pod(args: argparse.Namespace) -> int:
    lab = _attach(args)
    lab.delete_pod(args.pod, args.grace)
    if args.pod not in lab.pods:
        print(f"pod {args.pod} deleted")
        return 0
    if args.no_wait:
        argv = [sys.executable, "-m", "proxy", "lab", "-q", "delete-pod", args.pod, "--grace",
                str(args.grace), "--name", args.name]
        log = lab.logs_dir / "lab.log"
        with open(log, "ab") as f:
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        print(f"pod {args.pod} terminating for {args.grace:g}s (finishing in the background)")
        return 0
    print(f"pod {args.pod} terminating for {args.grace:g}s ...", flush=True)
    lab.wait_pod_gone(args.pod, timeout=args.grace + 10)
    print(f"pod {args.pod} deleted")
    return 0


def _logs(args: argparse.Namespace) -> int:
    logs = _run_dir(args) / "logs"
    candidates = [logs / f"{args.target}.log", logs / f"pod-{args.target}.log"]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        have = sorted(p.stem for p in logs.glob("*.log")) if logs.exists() else []
        print(f"kpx lab logs: no log for {args.target!r} in {logs}"
              + (f" (have: {', '.join(have)})" if have else ""), file=sys.stderr)
        return 1
    with open(path, "rb") as f:
        data = f.read()
        if args.lines:
            data = b"\n".join(data.splitlines()[-args.lines:]) + b"\n"
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        while args.follow:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            else:
                time.sleep(0.2)
    return 0


def _lb_address(args: argparse.Namespace) -> int:
    lab = _attach(args)
    ip, port = lab.lb_address()
    print(f"{ip}:{port}")
    return 0
