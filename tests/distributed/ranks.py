"""Run a function on n gloo ranks under torchrun and get each rank's return value back in pytest, as data.

    errors = on_ranks(2, "tests.distributed.tp_worker:errors", "torch")   # [rank 0's value, rank 1's value]
    assert max(errors[0].values()) <= TOL, errors[0]

The function is imported on every rank (tests/distributed/rank_runner.py) after the gloo process group is up,
called with the JSON-able args, and returns a JSON-able value; the assertions stay in pytest, where a failure
shows the values. A rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from tests.distributed.launcher import ROOT, SCRATCH, clean_shared_memory, rank_env, torchrun_cmd

RUNNER = os.path.join(ROOT, "tests", "distributed", "rank_runner.py")


def on_ranks(n: int, function: str, *args, env: dict | None = None, timeout: int = 600) -> list:
    """function: "module:name". Returns the list of the n ranks' return values, indexed by rank."""
    os.makedirs(SCRATCH, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        spec, out = os.path.join(tmp, "spec.json"), os.path.join(tmp, "value")
        with open(spec, "w") as f:
            json.dump({"function": function, "args": list(args), "out": out}, f)
        try:
            proc = subprocess.run(
                torchrun_cmd(n, RUNNER, spec),
                env=rank_env(**(env or {})),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            clean_shared_memory()
        if proc.returncode != 0:
            raise AssertionError(
                f"{function}{tuple(args)} on {n} ranks exited {proc.returncode}\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
            )
        values = []
        for rank in range(n):
            with open(f"{out}.{rank}.json") as f:
                values.append(json.load(f))
        return values
