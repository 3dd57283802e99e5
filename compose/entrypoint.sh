#!/bin/sh
# Entry point of every compose-lab container: install the routes this
# container's role needs, then become the real command.
#
# KPX_DEFAULT_VIA  pods: send everything via their node, as a CNI's veth route
#                  does, so a node that preserved the client IP sees the reply.
# KPX_ROUTES       nodes: "CIDR via IP" entries, comma-separated (the other
#                  nodes' pod CIDRs, like a flat-network CNI's host routes).
#
# Needs CAP_NET_ADMIN when either variable is set; touches only this
# container's own network namespace.
set -eu

if [ -n "${KPX_DEFAULT_VIA:-}" ]; then
    ip route replace default via "$KPX_DEFAULT_VIA"
fi

if [ -n "${KPX_ROUTES:-}" ]; then
    set -f
    old_ifs=$IFS
    IFS=','
    for route in $KPX_ROUTES; do
        IFS=$old_ifs
        # shellcheck disable=SC2086 # "CIDR via IP" must split into words
        ip route replace $route
        IFS=','
    done
    IFS=$old_ifs
    set +f
fi

exec "$@"
