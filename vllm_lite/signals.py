"""Process-level signal handling shared by the long-running commands (serve, headless)."""

from __future__ import annotations

import signal


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def exit_on_termination() -> None:
    """SIGTERM and Ctrl-C raise SystemExit(0) in the main thread: the command unwinds through its
    `finally` blocks (which stop the engines) and exits 0 instead of dying mid-cleanup."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_quietly)
