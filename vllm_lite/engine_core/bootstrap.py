"""`python -m vllm_lite.engine_core.bootstrap`: how a launcher starts an engine-core process.

The parent writes the pickled (EngineConfig, EngineIdentity) to our stdin: a private pipe from the
process that started us, never a socket. A fresh interpreter (rather than multiprocessing's spawn)
means the user's `__main__` is never re-imported, so a script without an `if __name__ ==
"__main__"` guard, a notebook or a REPL can start engines too. stdin is read before anything heavy
is imported, so the parent's write returns at once.
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    payload = sys.stdin.buffer.read()
    sys.stdin.close()
    config, identity = pickle.loads(payload)
    from vllm_lite.engine_core.proc import run_engine_core

    run_engine_core(config, identity)


if __name__ == "__main__":
    main()
