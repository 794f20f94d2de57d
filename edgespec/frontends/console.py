"""What the front ends share for the terminal: a rich console on standard error (progress bars
and notes go there; results go to standard output)."""

from __future__ import annotations

import sys


def stderr_console():
    from rich.console import Console

    return Console(file=sys.stderr)
