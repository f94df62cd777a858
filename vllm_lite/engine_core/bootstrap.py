"""`python -m vllm_lite.engine_core.bootstrap`: how a launcher starts an engine-core process.

The parent writes the pickled (EngineConfig, EngineIdentity) to our stdin: a private pipe from the
process that started us, never a socket. A fresh interpreter (rather than multiprocessing's spawn)
means the user's `__main__` is never re-imported, so a script without an `if __name__ ==
"__main__"` guard, a notebook or a REPL can start engines too. stdin is read before anything heavy
is imported, so the parent's write returns at once.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

PARENT_POLL_S = 0.25


def start_parent_watchdog(parent_pid: int) -> None:
    """Exit this process as soon as `parent_pid` is no longer its parent (it died)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        # os._exit: works even while the main thread is inside a long model step or an import.
        logging.getLogger(__name__).error("the parent process %d is gone; engine core exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main() -> None:
    # Before the heavy imports below (seconds of torch and transformers): no orphan even then.
    start_parent_watchdog(os.getppid())
    payload = sys.stdin.buffer.read()
    sys.stdin.close()
    config, identity = pickle.loads(payload)
    from vllm_lite.engine_core.proc import run_engine_core

    run_engine_core(config, identity)


if __name__ == "__main__":
    main()
