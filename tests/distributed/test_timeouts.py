"""A rank that hangs for real (SIGSTOP) mid-run ends the job within dist.step_timeout_s instead of the
start-up timeout: the other rank's next collective times out, it exits, and torchrun tears the job down so a
restart can happen; rank 0's last line names rank 1 as the one that stalled (megatron_lite/faults/stalls.py).
Start-up itself keeps the long dist.timeout_s (the run below starts and trains under a
5 s steady-state timeout only because that one applies from the second step on)."""

import json
import os
import re
import signal
import subprocess
import time

# the fault tests train on the real corpus (tests/distributed/common.py, real_corpus_overrides)
from tests.distributed.common import real_corpus_overrides as overrides
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env, torchrun_cmd
from tests.distributed.test_signals import workers


def test_hung_rank_ends_the_job_within_the_step_timeout(tmp_path):
    run_dir = f"{tmp_path}/hang"
    args = overrides(tmp_path, "hang", "train.steps=100000", "dist.step_timeout_s=5", "dist.timeout_s=600")
    proc = subprocess.Popen(torchrun_cmd(2, os.path.join(ROOT, "train.py"), *args), env=rank_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = workers(proc)
    try:
        while not os.path.exists(f"{run_dir}/metrics.jsonl") or len(open(f"{run_dir}/metrics.jsonl").readlines()) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs: alive, holding its sockets, doing nothing
        hung_at = time.time()
        _, err = proc.communicate(timeout=180)
        ended_after = time.time() - hung_at
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        clean_shared_memory()
    assert proc.returncode != 0
    # 5 s timeout + rank 0's exit + torchrun's shutdown (SIGTERM, then SIGKILL after its 30 s grace: the
    # stopped rank cannot act on SIGTERM); 600 s would have been the start-up timeout.
    assert ended_after < 90, f"the job took {ended_after:.0f} s to end after rank 1 hung"
    with open(f"{run_dir}/metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert len(steps) >= 3
    # rank 0 names the rank that stalled and the last step it finished (a step rank 0 logged too, or the one
    # before: rank 1 stopped somewhere between two heartbeats)
    named = re.search(r"a collective timed out: rank 1 \(last finished step (\d+)\) did not report", err)
    assert named, err[-3000:]
    assert steps[-1] - 1 <= int(named.group(1)) <= steps[-1], (named.group(0), steps)
    assert "rank 0 (" not in err, err[-3000:]
