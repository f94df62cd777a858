"""The `mp` launcher: one local process per DP rank."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import threading

from vllm_lite.config import EngineConfig
from vllm_lite.dp.env import DPEnv, free_port
from vllm_lite.launchers.base import EngineLauncher

# Engine processes back malloc's big arenas with huge pages (see cli.entry); the tunable is read
# at process start, so it goes into the environment the child starts with.
_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"


def _exit_reason(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _engine_env(dp_env: DPEnv) -> dict[str, str]:
    env = {**os.environ, **dp_env.to_env()}
    tunables = env.get("GLIBC_TUNABLES", "")
    if sys.platform.startswith("linux") and "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{_MALLOC_TUNABLE}" if tunables else _MALLOC_TUNABLE
    return env


class MPLauncher(EngineLauncher):
    """Engine cores as child processes of this one (fresh interpreters, see engine_core.bootstrap)."""

    def __init__(
        self, dp_size: int = 1, log_level: str = "WARNING", handshake_timeout_s: float = 600.0
    ) -> None:
        super().__init__()
        self.dp_size = dp_size
        self.log_level = log_level
        self.handshake_timeout_s = handshake_timeout_s
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._monitor_thread: threading.Thread | None = None

    @property
    def dp_ranks(self) -> list[int]:
        return list(range(self.dp_size))

    def _start_engines(self, config: EngineConfig, handshake_address: str) -> None:
        from vllm_lite.engine_core.proc import EngineIdentity

        master_port = free_port()
        identity = EngineIdentity(
            handshake_address=handshake_address,
            parent_pid=os.getpid(),
            handshake_timeout_s=self.handshake_timeout_s,
            log_level=self.log_level,
        )
        payload = pickle.dumps((config, identity))
        for rank in self.dp_ranks:
            process = subprocess.Popen(
                [sys.executable, "-m", "vllm_lite.engine_core.bootstrap"],
                stdin=subprocess.PIPE,
                env=_engine_env(DPEnv(self.dp_size, rank, rank, "127.0.0.1", master_port)),
                # Its own session: a signal to our process group (Ctrl-C, `timeout`, `kill -- -PGID`)
                # reaches the frontend only, which drains and then stops the engines itself. If we
                # die instead, the engine's parent watchdog ends it.
                start_new_session=True,
            )
            self.processes[rank] = process
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: the monitor reports it
                process.stdin.write(payload)
                process.stdin.close()

    def _start_monitor(self) -> None:
        self._monitor_thread = threading.Thread(target=self._monitor, name="engine-monitor", daemon=True)
        self._monitor_thread.start()

    def _monitor(self) -> None:
        # A pidfd becomes readable when its process exits: one poll watches every engine.
        by_fd = {os.pidfd_open(p.pid): rank for rank, p in self.processes.items()}
        try:
            while by_fd:
                readable, _, _ = select.select([*by_fd, self._wake_r], [], [])
                if self._wake_r in readable:
                    return
                for fd in readable:
                    rank = by_fd.pop(fd)
                    os.close(fd)
                    process = self.processes[rank]
                    process.wait()
                    self._report_death(rank, _exit_reason(process.returncode))
        finally:
            for fd in by_fd:
                os.close(fd)

    def _stop_engines(self, timeout_s: float) -> None:
        os.write(self._wake_w, b"x")
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if self._monitor_thread is not None:
            self._monitor_thread.join(timeout=timeout_s)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
