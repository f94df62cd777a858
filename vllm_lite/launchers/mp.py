"""The `mp` launcher: one local process per DP rank."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import select
import signal
import subprocess
import sys
import threading

from vllm_lite.config import EngineConfig
from vllm_lite.dp.env import DPEnv
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


def split_cpus(num_ranks: int) -> list[tuple[int, ...] | None]:
    """Each local rank's share of this process's CPUs (None for all ranks if there are fewer CPUs
    than ranks: then nobody is pinned)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // num_ranks
    if per == 0:
        return [None] * num_ranks
    return [tuple(cpus[i * per : (i + 1) * per]) for i in range(num_ranks)]


class MPLauncher(EngineLauncher):
    """Engine cores as child processes of this one (fresh interpreters, see engine_core.bootstrap).

    It starts the local ranks `start_rank .. start_rank + size_local - 1` of a DP group of
    `dp_size`; the handshake waits for all `dp_size` ranks (the others come from headless nodes).
    """

    def __init__(
        self,
        dp_size: int = 1,
        log_level: str = "WARNING",
        handshake_timeout_s: float = 600.0,
        dp_size_local: int | None = None,
        start_rank: int = 0,
        master_ip: str = "127.0.0.1",
        headless: bool = False,
    ) -> None:
        super().__init__()
        self.headless = headless
        self.dp_size = dp_size
        self.dp_size_local = dp_size if dp_size_local is None else dp_size_local
        self.start_rank = start_rank
        self.master_ip = master_ip
        self.log_level = log_level
        self.handshake_timeout_s = handshake_timeout_s
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._monitor_thread: threading.Thread | None = None

    @property
    def dp_ranks(self) -> list[int]:
        return list(range(self.dp_size))

    @property
    def local_ranks(self) -> list[int]:
        return list(range(self.start_rank, self.start_rank + self.dp_size_local))

    def _start_engines(self, config: EngineConfig, handshake_address: str) -> None:
        from vllm_lite.engine_core.proc import EngineIdentity

        shares = split_cpus(max(self.dp_size_local, 1))
        for local, rank in enumerate(self.local_ranks):
            identity = EngineIdentity(
                handshake_address=handshake_address,
                parent_pid=os.getpid(),
                handshake_timeout_s=self.handshake_timeout_s,
                log_level=self.log_level,
                cpu_ids=shares[local] if self.dp_size_local > 1 else None,
                local=not self.headless,
                headless=self.headless,
            )
            rank_config = config
            if config.device_config.num_threads is None and self.dp_size_local > 1:
                # Each rank's torch threads fill its own cores, not the whole machine.
                threads = len(shares[local]) if shares[local] else 1
                rank_config = dataclasses.replace(
                    config, device_config=dataclasses.replace(config.device_config, num_threads=threads)
                )
            # Port 0: rank 0 binds the DP group's store on a free port and publishes it.
            dp_env = DPEnv(self.dp_size, rank, local, self.master_ip, 0)
            process = subprocess.Popen(
                [sys.executable, "-m", "vllm_lite.engine_core.bootstrap"],
                stdin=subprocess.PIPE,
                env=_engine_env(dp_env),
                # Its own session: a signal to our process group (Ctrl-C, `timeout`, `kill -- -PGID`)
                # reaches the frontend only, which drains and then stops the engines itself. If we
                # die instead, the engine's parent watchdog ends it.
                start_new_session=True,
            )
            self.processes[rank] = process
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: the monitor reports it
                process.stdin.write(pickle.dumps((rank_config, identity)))
                process.stdin.close()

    def wait(self) -> None:
        """Block until every local engine has exited."""
        for process in self.processes.values():
            process.wait()

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
