"""``presize_fd_table``: the fd table is grown once at start, and nothing open is touched."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path


def _fd_size() -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^FDSize:\s+(\d+)", status, re.M)
    assert match, status
    return int(match.group(1))


def test_the_table_reaches_the_limit_and_later_opens_do_not_grow_it() -> None:
    # In a child: the table size is per process, and this one's is already big.
    code = textwrap.dedent(
        """
        import os, re, resource
        from pathlib import Path
        from proxy.commands.node import presize_fd_table
        def size():
            return int(re.search(r"^FDSize:\\s+(\\d+)", Path("/proc/self/status").read_text(),
                                 re.M).group(1))
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))
        before = size()
        reached = presize_fd_table()
        after = size()
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3000)]
        print(before, reached, after, size())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    before, reached, after, later = map(int, out)
    assert before < 4096
    assert reached == 4096
    assert after >= 4096
    assert later == after  # 3,000 more fds: no doubling left to do


def test_an_fd_already_at_the_top_is_never_clobbered(tmp_path: Path) -> None:
    from proxy.commands.node import presize_fd_table

    assert _fd_size() > 0
    marker = tmp_path / "marker"
    marker.write_text("mine")
    fd = os.open(marker, os.O_RDONLY)
    top = 200
    try:
        os.dup2(fd, top)
        assert presize_fd_table(limit=top + 1) == top + 1
        assert os.read(top, 4) == b"mine"  # still our file, not /dev/null
    finally:
        os.close(fd)
        os.close(top)
