"""A benchmark case's process, started a case ahead of its turn (tools/bench_gpu.py's throughput cases).

The protocol on the process's stdin and stdout, one line each: it starts up and prints READY; it reads its case,
builds and warms up, prints WARM and waits; on "go" it times its steps and prints `CASE <json>`, then exits.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_GPU = os.path.join(ROOT, "tools", "bench_gpu.py")


class CaseProcess:
    """One throughput case's process (`--serve`), started a case ahead: it imports torch, DeepSpeed,
    transformers and our packages and starts CUDA while the case before it builds its model and warms up, then
    waits for its own case on stdin. Case i's timed steps do not start until case i+1's process has finished
    that start-up, so no other process loads the host while a case is timed (the small model's step is
    host-bound). Each process still runs one case: its own CUDA context, allocator and compile caches."""

    def __init__(self, profile_dir: str | None = None, cmd: list[str] | None = None):
        profile = ["--profile", profile_dir] if profile_dir else []
        cmd = cmd or [sys.executable, BENCH_GPU, "--serve", *profile]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("RANK", None)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue = queue.Queue()  # stdout, line by line; None once it is closed
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):  # it has exited (crashed in start-up)
            return False

    def expect(self, prefix: str, deadline: float) -> str | None:
        """The first stdout line from now on that starts with prefix; None if the process ends first. Raises
        TimeoutError at the deadline (time.time())."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError from None
            if line is None:
                self.lines.put(None)  # stays closed for a later call
                return None
            if line.startswith(prefix):
                return line

    def close(self) -> None:
        """Kill it if it still runs; wait for it and for the last of its output."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def run(self, spec: str, timeout: float, after: CaseProcess | None) -> tuple[str | None, str]:
        """Run case `spec`; hold its timed steps until `after` (the next case's process) has started up. Returns
        the CASE line (None if it failed or was stopped) and, when there is none, why."""
        deadline = time.time() + timeout
        try:
            if self.send(spec) and self.expect("WARM", deadline) is not None:
                if after is not None:
                    after.expect("READY", deadline)  # None when it died in start-up: its own case will say so
                self.send("go")
                line = self.expect("CASE ", deadline)
                if line is not None:
                    self.proc.wait(timeout=max(1.0, deadline - time.time()))  # gone before the next case is timed
                    self.close()
                    return line, ""
            self.close()
            return None, "".join(self.stderr)
        except (TimeoutError, subprocess.TimeoutExpired):
            self.close()
            return None, "".join(self.stderr) + f"\nstopped after {timeout:.0f} s (the run's budget)"
