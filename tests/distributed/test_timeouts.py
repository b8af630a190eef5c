"""A rank that hangs for real (SIGSTOP) mid-run ends the job within dist.step_timeout_s instead of the
start-up timeout: the other rank's next collective times out and it exits, so torchrun tears the job down and a
restart can happen (the test kills the stopped rank then, as torchrun would after its 30 s grace); rank 0's last
line names rank 1 as the one that stalled (megatron_lite/faults/stalls.py). Start-up itself keeps the long
dist.timeout_s (the run below starts and trains under a 5 s steady-state timeout only because that one applies
from the second step on)."""

import json
import os
import re
import signal
import socket
import subprocess
import time

from megatron_lite.engine.build_locks import stat_fields

# the fault tests train on the real corpus (tests/distributed/common.py, real_corpus_overrides)
from tests.distributed.common import real_corpus_overrides as overrides
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, torchrun_cmd
from tests.distributed.test_signals import workers


def test_hung_rank_ends_the_job_within_the_step_timeout(tmp_path):
    run_dir = f"{tmp_path}/hang"
    args = overrides(tmp_path, "hang", "train.steps=100000", "dist.step_timeout_s=5", "dist.timeout_s=600")
    proc = subprocess.Popen(
        torchrun_cmd(2, os.path.join(ROOT, "train.py"), *args),
        env=rank_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = workers(proc)
    try:
        while not os.path.exists(f"{run_dir}/metrics.jsonl") or len(open(f"{run_dir}/metrics.jsonl").readlines()) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs: alive, holding its sockets, doing nothing
        hung_at = time.time()
        while not _exited(pids[0]) and time.time() < hung_at + 180:
            time.sleep(0.05)
        ended_after = time.time() - hung_at
        print(f"rank 0 ended {ended_after:.1f} s after rank 1 hung")
        # torchrun now stops rank 1 with SIGTERM, which a stopped process cannot act on, and SIGKILLs it after a
        # 30 s grace (torch's own shutdown_timeout, not configurable from its command line): do it at once
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        clean_shared_memory()
    assert proc.returncode != 0
    # the 5 s timeout, naming the stalled rank, and rank 0's exit (measured: 15 s); 600 s would be start-up's
    assert ended_after < 45, f"rank 0 took {ended_after:.0f} s to end after rank 1 hung"
    with open(f"{run_dir}/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert len(steps) >= 3
    # rank 0 names the rank that stalled and the last step it finished (a step rank 0 logged too, or the one
    # before: rank 1 stopped somewhere between two heartbeats)
    host = socket.gethostname()
    named = re.search(
        rf"a collective timed out: rank 1 \(host {re.escape(host)}, local rank 1; last finished step (\d+)\) did not report",
        err,
    )
    assert named, err[-3000:]
    assert steps[-1] - 1 <= int(named.group(1)) <= steps[-1], (named.group(0), steps)
    assert "rank 0 (" not in err, err[-3000:]


def _exited(pid: int) -> bool:
    """Whether the process has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        return stat_fields(pid)[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
