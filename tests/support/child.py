"""A ``python -c`` script in a child process, talked to line by line over stdin/stdout.

For tests whose "other kpx" is a few lines of Python (an ownership holder,
a stopping owner offering its sockets): the repository is importable in the
child (``PYTHONPATH``), ``say`` writes one line, ``line`` reads one,
``stop`` kills the child if it still runs and reaps it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


class Child:
    def __init__(self, script: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)
