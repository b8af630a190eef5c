"""slurm/train.sbatch on a real two-node Slurm cluster (tests/slurm/cluster.py), one task per node, gloo:

- a job that trains to its last step;
- a job whose batch shell gets SIGUSR1 mid-run (what --signal=B:USR1@120 sends before the time limit): the
  ranks checkpoint at the next step boundary and exit 0, the script requeues the job, which resumes from
  `latest` and finishes; every step is logged exactly once;
- a job stopped once (requeued) and then one of whose ranks is SIGKILLed: srun ends the other, the script
  requeues the job (a crash, the first: the stop does not count against MAX_RESTARTS), which resumes from the
  last checkpoint and finishes; steps after that checkpoint run again (logged once);
- a job cancelled with `scancel`: the ranks checkpoint and stop, and the job stays cancelled (no requeue);
- a job with a configuration error: refused in the batch shell with the one-line error, exit 2, no requeue.
Every step the three jobs log has the loss of the uninterrupted job's same step (1e-6: exact resume, the same
ranks and layout), and the checkpoints on disk are the ones the runs committed."""

import functools
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_lite.checkpoint.store import complete_steps, latest_checkpoint, step_name
from megatron_lite.parallel.context import free_port
from tests.distributed.common import logged_records
from tests.distributed.launcher import ROOT, clean_shared_memory, rank_env

STEPS, INTERVAL = 40, 5
TRAIN = [
    f"train.steps={STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    f"checkpoint.interval={INTERVAL}",
    "checkpoint.keep=0",
    "logging.wandb.mode=disabled",
    "train.precision=fp32",
    "train.eval_interval=0",
    "dist.step_timeout_s=60",
]


def submit(cluster, run_dir: str, *overrides: str, nodes: str = "2", tasks: str = "1", **env: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    args = [
        f"--nodes={nodes}",
        f"--ntasks-per-node={tasks}",
        f"--output={run_dir}/slurm.out",
        "--job-name=ci",
        os.path.join(ROOT, "slurm/train.sbatch"),
        f"run.dir={run_dir}",
        *TRAIN,
        *overrides,
    ]
    # a free rendezvous port rather than the script's job-id default: job ids restart at 1 in every test cluster
    env = rank_env(PY=os.path.join(ROOT, ".venv/bin/python"), TRAIN_MASTER_PORT=str(free_port()), **env)
    return cluster.submit(args, cwd=ROOT, env=env)


def wait_for_step(run_dir: str, step: int, cluster, job: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not any(r["step"] >= step for r in logged_records(run_dir)):
        assert time.time() < deadline, f"job {job} did not reach step {step}: {cluster.state(job)}"
        time.sleep(0.2)


def finish(cluster, job: str, run_dir: str) -> tuple[list[dict], str]:
    cluster.wait_done(job, timeout=600)
    clean_shared_memory()
    with open(os.path.join(run_dir, "slurm.out")) as f:
        out = f.read()
    return logged_records(run_dir), out


def assert_checkpoints(run_dir: str) -> None:
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == os.path.join(root, step_name(STEPS))
    steps = [int(os.path.basename(p)[5:]) for p in complete_steps(root)]
    assert set(range(INTERVAL, STEPS + 1, INTERVAL)) <= set(steps), steps


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The uninterrupted job, submitted when the first test asks for it; calling the fixture's value waits for it
    (run dir, records, output). Each node has 4 CPUs and a job takes one, so it trains beside that test's own job:
    both wait on Slurm and on start-up most of the time (measured: the cores ~60% busy over these tests)."""
    run_dir = str(tmp_path_factory.mktemp("sbatch") / "straight")
    job = submit(cluster, run_dir)

    @functools.cache
    def result() -> tuple[str, list[dict], str]:
        return run_dir, *finish(cluster, job, run_dir)

    return result


def losses_match(records: list[dict], reference: list[dict]) -> None:
    want = {r["step"]: r["loss"] for r in reference}
    worst = max(abs(r["loss"] - want[r["step"]]) for r in records)
    assert worst <= 1e-6, f"a resumed step's loss differs from the uninterrupted job's by {worst:.2e}"


@pytest.mark.slow  # first: its job trains beside the uninterrupted one (the fixture)
def test_usr1_checkpoints_requeues_and_resumes(cluster, uninterrupted, tmp_path):
    run_dir = str(tmp_path / "usr1")
    job = submit(cluster, run_dir)
    wait_for_step(run_dir, 3, cluster, job)
    cluster.signal_batch(job, "USR1")
    records, out = finish(cluster, job, run_dir)
    stop = re.search(r"stop signal: saved at step (\d+)", out)
    assert stop and "requeueing job" in out, out[-3000:]
    # every step once, in order, across the requeue; the steps after the stop come from the requeued run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), out[-3000:]
    assert {r["restarts"] for r in records if r["step"] > int(stop.group(1))} == {1}
    losses_match(records, uninterrupted()[1])
    assert_checkpoints(run_dir)


def test_a_job_trains_to_its_last_step(uninterrupted):
    run_dir, records, out = uninterrupted()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), out[-3000:]
    assert "2 node(s) x 1 task(s)" in out and "requeueing" not in out, out[-3000:]
    assert all(r["restarts"] == 0 for r in records)
    assert_checkpoints(run_dir)


@pytest.mark.slow
def test_a_killed_rank_is_requeued_and_resumes(cluster, uninterrupted, tmp_path):
    """MAX_RESTARTS=1 after a stop's requeue: the stop is not a crash, so the kill still gets its one requeue."""
    run_dir = str(tmp_path / "kill")
    job = submit(cluster, run_dir, MAX_RESTARTS="1")
    wait_for_step(run_dir, 3, cluster, job)
    cluster.signal_batch(job, "USR1")
    wait_for_step(run_dir, 2 * INTERVAL + 2, cluster, job)  # resumed, a checkpoint after the stop, steps after it
    ranks = subprocess.run(
        ["pgrep", "-f", f"train.py run.dir={run_dir} "], capture_output=True, text=True
    ).stdout.split()
    assert ranks, "no rank found to kill"
    os.kill(int(ranks[-1]), signal.SIGKILL)
    records, out = finish(cluster, job, run_dir)
    assert "(restart 1, after a stop)" in out and "(restart 2, crash 1 of at most MAX_RESTARTS=1)" in out, out[-3000:]
    # The requeued job drops the records of the steps it runs again (metrics.jsonl has every step once); the
    # restart count (Slurm's) tells where it took over: right after a checkpoint the first job committed.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), [r["step"] for r in records]
    resumed = next(r["step"] for r in records if r["restarts"] == 2)
    assert (resumed - 1) % INTERVAL == 0 and resumed - 1 >= 2 * INTERVAL, records
    losses_match(records, uninterrupted()[1])
    assert_checkpoints(run_dir)


def test_a_config_error_ends_the_job_in_one_line_without_requeue(cluster, tmp_path):
    run_dir = str(tmp_path / "bad")
    job = submit(cluster, run_dir, "parallel.tp=3")  # 3 does not divide the 2 ranks
    records, out = finish(cluster, job, run_dir)
    errors = [line for line in out.splitlines() if "error" in line]
    assert errors == [
        "config error: parallel.tp=3 makes tp*cp*pp=3 (tp=3, cp=1, pp=1), which must divide the "
        "world size 2; pick tp*cp*pp among 1 or 2"
    ], out[-3000:]
    assert "requeueing" not in out and "Traceback" not in out and not records, out[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))


@pytest.mark.slow
def test_scancel_checkpoints_and_ends_the_job_for_good(cluster, uninterrupted, tmp_path):
    run_dir = str(tmp_path / "scancel")
    job = submit(cluster, run_dir)
    wait_for_step(run_dir, 3, cluster, job)
    cluster.cancel(job)
    records, out = finish(cluster, job, run_dir)
    stop = re.search(r"stop signal: saved at step (\d+)", out)
    assert stop and "not requeued" in out and "requeueing" not in out, out[-3000:]
    stopped = int(stop.group(1))
    assert stopped < STEPS and [r["step"] for r in records] == list(range(1, stopped + 1)), out[-3000:]
    root = os.path.join(run_dir, "checkpoints")
    assert latest_checkpoint(root) == os.path.join(root, step_name(stopped))
    losses_match(records, uninterrupted()[1])


@pytest.mark.slow
def test_a_straggler_stop_requeues_the_job_without_its_node(cluster, uninterrupted, tmp_path):
    """Two ranks on one node, one of them stopped and continued from outside (half its time stopped) with
    faults.straggler_action=stop: every rank checkpoints and exits 5, the script adds the node to the job's
    ExcNodeList and requeues it, and the job resumes on the other node and finishes, each step logged once with
    the uninterrupted job's loss (a straggler stop is a stop, not a crash)."""
    from tests.distributed.test_stragglers import duty_cycle, rank_pid

    run_dir = str(tmp_path / "straggler")
    watch = ["train.log_interval=2", "faults.straggler_ratio=1.5", "faults.straggler_intervals=3"]
    job = submit(cluster, run_dir, *watch, "faults.straggler_action=stop", nodes="1", tasks="2")
    wait_for_step(run_dir, 2, cluster, job)
    ranks = subprocess.run(["pgrep", "-f", f"train.py run.dir={run_dir} "], capture_output=True, text=True)
    with duty_cycle(rank_pid([int(p) for p in ranks.stdout.split()], 1)):
        while not os.path.exists(os.path.join(run_dir, "straggler.json")):
            assert "RUNNING" in cluster.state(job) or "PENDING" in cluster.state(job), cluster.state(job)
            time.sleep(0.2)
    records, out = finish(cluster, job, run_dir)
    left_out = re.search(r"after a straggler stop, leaving out node (\S+)\)", out)
    nodes = re.findall(r"node\(s\) x 2 task\(s\), 0 GPU\(s\) per node, nodes (\S+),", out)
    assert left_out and len(nodes) == 2 and nodes[0] == left_out.group(1) != nodes[1], out[-3000:]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), out[-3000:]
    losses_match(records, uninterrupted()[1])
