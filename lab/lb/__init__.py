"""The lab's external load balancer: what a cloud L4 LB does, in its own namespace.

Owns: the modules that make it, split by who runs them: ``config`` (the
``loadBalancer`` section of a lab file, its defaults and meaning),
``rules`` (pure decisions: probe verdicts, the serving set, the PROXY
header, how a failure is named), ``nft`` (the nftables table ``ip kpx_lb``
of passthrough mode), ``probe`` (the health checks), ``daemon`` (the
process inside the LB namespace), and ``control`` (the lab's and the CLI's
side: starting, reconfiguring, stopping and reading the daemon).
``lab.loadbalancer`` re-exports their public names and is the daemon's
``python -m`` entry point.

Never: touch any namespace but the LB's own (the daemon runs inside it via
``ip netns exec`` and every ``nft`` call inherits that namespace), send
traffic anywhere but the lab's node addresses, or decide anything about
Kubernetes semantics. The LB knows nodes, ports and probe answers, exactly
as much as a cloud LB knows; whether a node *should* answer is kpx's job.
This package imports nothing of its own here, so each role pays only for
the modules it uses.

Theory of operation:

- One daemon per lab: ``python -m lab.loadbalancer --config <run_dir>/lb.json``,
  started by ``start(lab)`` in the LB namespace in its own session, so it
  outlives ``kpx lab up``. ``LoadBalancerHandle.stop()`` (called by lab
  teardown) ends it by pid.
- One probe task per node, sequential, so a node never has two probes in
  flight: probe, record, sleep out the rest of the interval. A result moves
  the node's state only through the pure ``observe()``: ``initial`` becomes
  ``healthy`` after ``healthyThreshold`` consecutive passes and ``unhealthy``
  after ``unhealthyThreshold`` consecutive failures, and a decided node flips
  only after that many contrary results in a row, as GCP/AWS health checks
  count them.
- The serving set is the healthy nodes, in spec order. If no node is healthy
  the LB **fails open** to every node, as GCP's passthrough NLB and AWS's NLB
  do: sending traffic to possibly broken backends beats blackholing a whole
  service because its health check is misconfigured. ``failOpen`` in the
  status file says when that is happening.
- passthrough: a DNAT to ``numgen inc mod N map {i : nodeIP . nodePort}``. The
  client's IP reaches the node, and since nodes route the client network back
  via the LB, conntrack un-DNATs the replies. When the serving set changes the
  rule is flushed and re-added in one ``nft -f -`` transaction, so no packet
  ever sees a half-written rule. ``numgen inc`` is a per-rule counter that
  advances once per new connection (nat chains only see a connection's first
  packet), which is what makes the round-robin deterministic. Per-node named
  counters in the nat postrouting chain count the client connections each
  node got: only those whose conntrack original destination is the front, so
  the LB's own probes (which a TCP check on the nodePort sends to exactly
  ``nodeIP:nodePort``) are never counted.
- proxy: an asyncio server on the front address that dials nodeIP:nodePort
  from the LB (the node sees 10.77.0.2), optionally prefixed with a PROXY v1
  or v2 header, and relays both directions with half-close.
- ``lb-status.json`` is replaced atomically whenever a verdict, a probe's
  answer or the serving set changes; ``ready`` turns true once every node
  has left ``initial``, which is what ``start()`` waits for.
- ``kpx lab apply`` calls ``on_apply(lab)``: a changed nodePort,
  healthCheckNodePort or section is written to ``lb.json`` and the daemon
  reloads on SIGHUP, keeping its pid and (probe unchanged) its verdicts.
"""
