"""A real `vllm-lite serve` process for tests: free port, bounded startup, no process left behind.

Not a test module. Usage::

    with OpenAIServer(["--max-model-len", "1024"], api_key="k") as server:
        client = server.client()
        client.completions.create(model=server.model, prompt="Hi", max_tokens=4)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import openai
import psutil

try:
    import httpx
except ImportError:  # the environment may ship the client under its new name only
    import httpx2 as httpx  # type: ignore[no-redef]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = "smollm2-135m"


def free_port() -> int:
    """A TCP port nobody listens on right now (the server binds it before loading anything)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent has yet to reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(procs: Sequence[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """SIGKILL every process still alive and wait for them; returns those that were alive."""
    leftovers = [p for p in procs if alive(p)]
    for p in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(leftovers, timeout=timeout)
    return leftovers


class OpenAIServer:
    """`python -m vllm_lite.cli serve MODEL --port P [extra args]` as a subprocess.

    Entering starts it and waits (bounded) until `/health` answers 200; leaving sends SIGTERM,
    waits, and SIGKILLs whatever of its process tree is still there. The server's output goes to
    a temporary file whose tail is shown when something fails.
    """

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        served_model_name: str | None = None,
        startup_timeout: float = 180.0,
        shutdown_timeout: float = 60.0,
    ) -> None:
        self.model_arg = model
        self.model = served_model_name or model
        self.api_key = api_key
        self.extra_args = list(extra_args)
        if served_model_name:
            self.extra_args += ["--served-model-name", served_model_name]
        if api_key:
            self.extra_args += ["--api-key", api_key]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._ps: psutil.Process | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-lite-serve-", suffix=".log", delete=False)
        self._known: dict[int, psutil.Process] = {}
        self._saved_output: str | None = None

    # -------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> OpenAIServer:
        if self.proc is None:
            self.spawn()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """stop(), then drop the log file (its text stays readable through output())."""
        try:
            self.stop()
        finally:
            if self._saved_output is None:
                self._saved_output = self.output()
                self._log.close()
                with contextlib.suppress(OSError):
                    os.unlink(self._log.name)

    def start(self) -> None:
        """Start the server and wait until it is healthy."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting (several servers can then load side by side)."""
        self.port = free_port()
        self._spawn()

    def wait_ready(self) -> None:
        """Wait (bounded) until /health answers 200; a port taken meanwhile is retried once."""
        try:
            if not self._wait_healthy(retry_on_port_clash=True):
                self.spawn()
                self._wait_healthy(retry_on_port_clash=False)
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env.pop("VLLM_LITE_API_KEY", None)
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "vllm_lite.cli",
            "serve",
            self.model_arg,
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        if "--log-level" not in self.extra_args:
            cmd += ["--log-level", "warning"]
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._ps = psutil.Process(self.proc.pid)
        self._known = {self.proc.pid: self._ps}

    def _wait_healthy(self, retry_on_port_clash: bool) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self.remember_children()
            code = self.proc.poll()
            if code is not None:
                output = self.output()
                if retry_on_port_clash and "cannot listen" in output:
                    self.stop()
                    return False
                raise AssertionError(f"vllm-lite serve exited with {code} during startup:\n{output}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", headers=self.headers(), timeout=2.0).status_code == 200:
                    self.remember_children()
                    return True
            time.sleep(0.25)
        raise AssertionError(
            f"vllm-lite serve not healthy after {self.startup_timeout:.0f} s:\n{self.output()}"
        )

    def remember_children(self) -> None:
        """Note every descendant seen so far, so that stop() can find them even once orphaned."""
        if self._ps is None:
            return
        with contextlib.suppress(psutil.Error):
            for child in self._ps.children(recursive=True):
                self._known.setdefault(child.pid, child)

    def terminate(self, timeout: float | None = None) -> int | None:
        """SIGTERM the server and wait for it to exit (bounded); returns its exit code or None."""
        if self.proc is None:
            return None
        self.remember_children()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.shutdown_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> list[psutil.Process]:
        """Terminate, then SIGKILL leftovers of the whole tree; returns the processes that had to
        be killed (the server itself included if SIGTERM did not stop it)."""
        if self.proc is None:
            return []
        self.terminate()
        leftovers = kill_tree(list(self._known.values()))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return leftovers

    # -------------------------------------------------------------------------- accessors

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: object) -> openai.OpenAI:
        """An OpenAI client for this server; no retries (a retry would hide a failure)."""
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    def http(self, **kwargs: object) -> httpx.Client:
        """A plain HTTP client on the server's root URL, with the API key when there is one."""
        kwargs.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.url, headers=self.headers(), **kwargs)

    def children(self) -> list[psutil.Process]:
        """The server's live descendants (engine cores, ...)."""
        assert self._ps is not None
        try:
            return [p for p in self._ps.children(recursive=True) if alive(p)]
        except psutil.NoSuchProcess:
            return []

    def engine_processes(self) -> list[psutil.Process]:
        """The engine-core children (`python -m vllm_lite.engine_core.bootstrap`)."""
        engines = []
        for p in self.children():
            with contextlib.suppress(psutil.Error):
                if any("bootstrap" in part for part in p.cmdline()):
                    engines.append(p)
        return engines

    def known_processes(self) -> list[psutil.Process]:
        """The server and every descendant seen so far."""
        self.remember_children()
        return list(self._known.values())

    def output(self, tail: int = 8000) -> str:
        """The last `tail` characters the server printed."""
        if self._saved_output is not None:
            return self._saved_output[-tail:]
        self._log.flush()
        with open(self._log.name, "rb") as f:
            data = f.read()
        return data[-tail:].decode(errors="replace")
