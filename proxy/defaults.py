"""What kpx's flags default to, where a module below the commands uses the same value.

Why a module of its own: ``kpx node`` parses and checks its flags, then
claims its network namespace, before it imports the dataplane. A restart's
successor must ask for the listeners within the old process's
``--handover-wait`` even on a busy node (``proxy.commands.node``), and the
modules these values belong with import the HTTP client, the metrics
registry or pyroute2. kube-proxy keeps its defaults apart from its proxiers
the same way (``pkg/proxy/apis/config/v1alpha1/defaults.go``).

Defaults of modules that are already light to import stay with them:
``proxy.core.flows`` (the UDP conntrack timeouts), ``proxy.nfqueue.rules``
(the queue number), ``proxy.nfqueue.conntrack`` (conntrack sizing).

Never: import anything.
"""

TCP_TIMEOUT_ESTABLISHED = 24 * 3600.0
"""kube-proxy's ``--conntrack-tcp-timeout-established`` default: idle seconds before a reset."""
TCP_TIMEOUT_CLOSE_WAIT = 3600.0
"""kube-proxy's ``--conntrack-tcp-timeout-close-wait`` default: idle seconds after a FIN."""

UDP_FLOW_LIMIT = 4096
"""Default ``--udp-flow-limit``: a socket each, next to the TCP relays' two per connection."""

DEFAULT_BATCH_WAIT = 100e-6
"""``--queue-batch-wait``: short beside a connection's own round trips, long enough for a
busy node's SYNs to come in batches (docs/PERFORMANCE.md, "SYN batches")."""
MAX_BATCH_WAIT = 0.01
"""Past this, a wait is a delay users would see on every connection of a busy node,
and stopping the reader would wait it out."""

DEFAULT_MAX_BYTES = 128 << 20
"""``--state-max-bytes``: 30,000 NodePort services x 3 endpoints are 26 MB as the
bench renders them (kubectl-style multi-document YAML) and 52 MB as a
``kind: List`` with uids and resourceVersions; 128 MiB leaves room above both."""
