"""tools/build_ops.py stopped by SIGTERM mid-compile (the test session stops its background build that way when it
ends early): the build ends at once, with its compilers, and leaves no lock. A real build of DeepSpeed's smallest
CPU op, into an empty extension folder of the test's own."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.launcher import ROOT


def _working_in(folder: str) -> list[tuple[int, str]]:
    """(pid, name) of every process whose working directory is inside `folder` (ninja and its compile jobs run in
    the op's build folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(folder + os.sep):
                with open(f"/proc/{pid}/comm") as f:
                    found.append((int(pid), f.read().strip()))
        except OSError:  # ended meanwhile
            continue
    return found


def test_sigterm_mid_compile_stops_the_compilers_and_releases_the_lock(tmp_path):
    extensions = str(tmp_path / "torch_extensions")
    build = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tools", "build_ops.py"), "ShareMemCommBuilder"],
        env=dict(os.environ, TORCH_EXTENSIONS_DIR=extensions),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not any(name == "cc1plus" for _, name in _working_in(extensions)):
            if build.poll() is not None or time.time() > deadline:
                build.kill()
                out = build.communicate()[0]
                if "cannot build here" in out or "not cpu" in out or "ready in" in out:
                    pytest.skip(f"no CPU op compiled here: {out.strip().splitlines()[-1]}")
                raise AssertionError(f"no compiler was seen running within 300 s:\n{out[-3000:]}")
            time.sleep(0.05)
        build.send_signal(signal.SIGTERM)  # to build_ops alone, as tests/conftest.py stops it
        out = build.communicate(timeout=60)[0]
    finally:
        if build.poll() is None:
            build.kill()
    assert build.returncode == 128 + signal.SIGTERM, out[-3000:]
    time.sleep(0.5)  # a compiler killed just now is reaped by init
    assert _working_in(extensions) == [], "compile jobs still run after the build ended"
    locks = [os.path.join(d, f) for d, _, files in os.walk(extensions) for f in files if f == "lock"]
    assert locks == [], locks
