"""``kpx bench``: kpx measured against direct routing, kernel DNAT, HAProxy and naive asyncio.

Owns: the package's name only; ``bench.cli`` is the command, ``bench.runner``
one run of it.

Never: import ``proxy`` or ``healthz``: kpx is measured as a black box through
the ``kpx`` command. The plumbing shared with the lab comes from
``lab.common`` and ``lab.netns``, nothing else of ``lab``.

See bench/README.md for how to run it, what each figure means, and the
harness pitfalls (TIME_WAIT, conntrack, descriptor limits) it handles.
"""
