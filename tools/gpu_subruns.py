"""What a `make bench-gpu` session (tools/bench_gpu.py) runs besides its throughput cases, each in a fresh process
from the checkout's root within a time budget: the CUDA tests (their counts and each failure's first line) and
the other bench tools (the JSON each writes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_pytest(out_dir: str, quick: bool, timeout: float) -> dict:
    """tests/gpu and the kernel unit tests' CUDA cases; their counts, and each failure's first line, from pytest's
    junit XML (the printed tail of a failing compile test is mostly dynamo's logging)."""
    import xml.etree.ElementTree as ET

    xml = os.path.join(out_dir, "gpu_pytest.xml")
    units = (
        ["tests/unit/test_kernels_norm.py"]
        if quick
        else [f"tests/unit/test_kernels_{name}.py" for name in ("norm", "pointwise", "cross_entropy")]
        + ["tests/unit/test_ring_blocks.py"]
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--junitxml",
        xml,
        "-p",
        "no:logging",
        "tests/gpu",
        *units,
        "-k",
        "cuda or gpu",
    ]  # gpu: all of tests/gpu
    stdout, stderr, exit_code = _run(cmd, timeout)
    print("\n".join((stdout + stderr).strip().splitlines()[-30:]))
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures = []
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            if "failure" in kinds or "error" in kinds:
                counts["failed" if "failure" in kinds else "errors"] += 1
                why = next(child.get("message") or "" for child in case if child.tag in ("failure", "error"))
                failures.append(
                    f"{case.get('classname')}::{case.get('name')}: {why.splitlines()[0][:300] if why else ''}"
                )
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        os.remove(xml)
    return {**counts, "failures": failures, "exit_code": exit_code}


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[str, str, int | str]:
    """stdout, stderr and exit code of cmd, run from the checkout's root. A process that outruns `timeout`
    seconds is killed; its exit code is then the sentence that says so."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # its output may be bytes, str or None
        text = [out.decode(errors="replace") if isinstance(out, bytes) else out or "" for out in (e.stdout, e.stderr)]
        return text[0], text[1], f"stopped after {timeout:.0f} s (the run's budget)"


def run_tool(name: str, out_dir: str, quick: bool, timeout: float, extra: tuple[str, ...] = ()) -> dict | None:
    """Run tools/<name>.py --out <json> [extra] in a fresh process, show its last lines, return what it wrote (None
    when it wrote nothing, or did not finish within `timeout` seconds)."""
    path = os.path.join(out_dir, f"_{name}.json")
    stdout, stderr, code = _run(
        [sys.executable, f"tools/{name}.py", "--out", path, *extra] + (["--quick"] if quick else []), timeout
    )
    stopped = f"\n{name}: {code}" if isinstance(code, str) else ""
    print("\n".join((stdout + stderr + stopped).strip().splitlines()[-40:]), flush=True)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        found = json.load(f)
    os.remove(path)
    return found
