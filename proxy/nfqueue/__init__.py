"""The ``--proxy-mode nfqueue`` dataplane: SYN-time decisions in Python, the rest in conntrack.

``netlink``: the NFQUEUE protocol and one queue socket. ``rules``: the nft
table and the iptables rule that queue served SYNs and carry out verdicts.
"""
