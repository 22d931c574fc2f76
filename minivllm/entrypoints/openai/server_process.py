"""Start `minivllm serve` in a child process, wait until it answers, stop it: for tests, notebooks
and the serving benchmark (`--launch`). Standard library only.

    with ServerProcess(model_dir, ["--max-model-len", "512"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY")

The server binds a free port (--port 0) and prints its address; every wait has a deadline, and the
process is always stopped (SIGTERM, then SIGKILL).
"""
import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque

import minivllm

_ADDRESS = re.compile(r"serving on (http://\S+)")


class ServerProcess:
    """A `python -m minivllm.entrypoints.cli serve` child process (what `minivllm serve` runs).

    The light `cli` module is the child's __main__, so the engine-core process it spawns (which
    imports the spawning __main__ again) does not import fastapi and uvicorn for nothing.

    Args:
        model: model directory.
        args: further command-line flags (engine flags, --api-key, ...).
        env: extra environment variables for the child.
        startup_timeout: seconds to wait for the first healthy response.
    """

    def __init__(self, model: str, args: list[str] | None = None, env: dict | None = None,
                 startup_timeout: float = 300.0, host: str = "127.0.0.1"):
        self.command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", model,
                        "--host", host, "--port", "0", *(args or [])]
        # The child imports the same minivllm as this process (a checkout used through PYTHONPATH too).
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))
        python_path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "PYTHONPATH": python_path, **(env or {})}
        self.startup_timeout = startup_timeout
        self.url: str | None = None
        self.startup_seconds: float | None = None
        self.log = deque(maxlen=200)  # the child's last output lines
        self.proc: subprocess.Popen | None = None
        self._address_seen = threading.Event()

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> "ServerProcess":
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        atexit.register(self.stop)  # a crashed caller must not leave a server behind
        threading.Thread(target=self._read_output, daemon=True).start()
        try:
            self._wait_healthy(start + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - start
        return self

    def _read_output(self):
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            match = _ADDRESS.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._address_seen.set()

    def _wait_healthy(self, deadline: float):
        while not self._address_seen.wait(timeout=0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n" + self.log_tail())
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the server did not start within {self.startup_timeout:.0f} s:\n" + self.log_tail())
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.perf_counter() > deadline:
                raise TimeoutError("the server never answered /health:\n" + self.log_tail())
            time.sleep(0.1)

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(list(self.log)[-num_lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server aborts in-flight requests and exits); SIGKILL after `timeout` seconds.
        Returns the exit code."""
        if self.proc is None:
            return None
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
