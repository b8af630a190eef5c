"""Where the suite leaves the cores idle: a pytest plugin, off unless asked for.

    .venv/bin/python -m pytest -q tests -p tests.utils.cpu_use        # or: make test ARGS="-p tests.utils.cpu_use"

Per test (setup, call and teardown together): its wall time and the machine's busy CPU time over it, from
/proc/stat, so every process counts (torchrun's ranks, Slurm's, background jobs). Idle core-seconds, cores x wall
- busy, are what a test could have shared with another. At the end it prints the machine's use over the session and
the tests that left the most idle; CPU_USE_OUT=path also writes one JSON line per test. Background jobs on idle
time (tests/conftest.py) fill the idle they find, so measure the session's shape with them done or deselected.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_rows: list[dict] = []


def _busy_s() -> float:
    """The machine's busy CPU seconds since boot, all cores."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, wall = _busy_s(), time.monotonic()
    yield
    wall, busy = time.monotonic() - wall, _busy_s() - busy
    _rows.append(
        {
            "test": item.nodeid,
            "wall_s": round(wall, 2),
            "busy_s": round(busy, 2),
            "idle_s": round(max(os.cpu_count() * wall - busy, 0.0), 2),
        }
    )
    if os.environ.get("CPU_USE_OUT"):
        with open(os.environ["CPU_USE_OUT"], "a") as f:
            f.write(json.dumps(_rows[-1]) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    cores, wall, busy = os.cpu_count(), sum(r["wall_s"] for r in _rows), sum(r["busy_s"] for r in _rows)
    write = terminalreporter.write_line
    terminalreporter.section("CPU use (tests/utils/cpu_use.py)")
    write(
        f"{len(_rows)} tests, {wall:.0f} s: the {cores} cores busy {busy / (cores * wall):.0%} of the time "
        f"({cores * wall - busy:.0f} idle core-seconds)"
    )
    for r in sorted(_rows, key=lambda r: -r["idle_s"])[:15]:
        write(f"{r['idle_s']:8.1f} idle core-s {r['wall_s']:8.1f} s  {r['test']}")
