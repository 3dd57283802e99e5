"""``kpx bench``: kpx measured against direct routing, kernel DNAT, HAProxy and naive asyncio.

See bench/README.md for how to run it, what each figure means, and the
harness pitfalls (TIME_WAIT, conntrack, descriptor limits) it handles.
"""
