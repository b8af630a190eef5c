"""A real two-node Slurm cluster on this machine (Debian's slurmctld + two slurmd, munge), for the tests of
slurm/train.sbatch. The facts it relies on are measured in ../shared/SLURM_CI.md: node names that are IP
addresses (127.0.0.1, 127.0.0.2) so the first node's name is a rendezvous address, multiple slurmd on one
host, cred_expire=10 and a 2 s scheduling loop so a requeued job starts again within seconds. Everything lives in one scratch
directory; every daemon is started here and stopped by the pid in its pid file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

NODES = ("127.0.0.1", "127.0.0.2")

CONF = """ClusterName=ci
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket.2,cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
MinJobAge=10
SlurmdParameters=config_overrides
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (slurmd runs jobs as their user; `make test` installs Slurm as root)"
    missing = [path for path in (*DAEMONS, shutil.which("sbatch") or "sbatch") if not os.path.exists(path)]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): `make system-deps` installs it as root"
    return None


class Cluster:
    def __init__(self, scratch: str):
        from megatron_lite.parallel.context import free_port

        self.dir = scratch
        self.conf = os.path.join(scratch, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.pid_files = [
            os.path.join(scratch, "munge", "munged.pid"),
            os.path.join(scratch, "slurmctld.pid"),
            *(os.path.join(scratch, f"slurmd-{node}.pid") for node in NODES),
        ]
        # free ports, not Slurm's defaults: another cluster on this machine (a second test run) keeps its own
        self.ctld_port, self.node_ports = free_port(), [free_port() for _ in NODES]

    def start(self) -> None:
        d = self.dir
        for sub in ("munge", "log", "state", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        shutil.chown(os.path.join(d, "munge"), "munge", "munge")
        with open(self.conf, "w") as f:
            f.write(
                CONF.format(
                    d=d,
                    ctld_port=self.ctld_port,
                    node_lines="\n".join(
                        f"NodeName={node} NodeHostname=localhost Port={port} CPUs=4 RealMemory=4000 State=UNKNOWN"
                        for node, port in zip(NODES, self.node_ports)
                    ),
                )
            )
        munge = os.path.join(d, "munge")
        self._run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "/usr/sbin/munged",
                f"--socket={munge}/munge.socket.2",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ]
        )
        self._run(["/usr/sbin/slurmctld", "-f", self.conf])
        for node in NODES:
            self._run(["/usr/sbin/slurmd", "-f", self.conf, "-N", node])
        deadline = time.time() + 60
        while self.query(["sinfo", "-h", "-o", "%T %D"]) != "idle 2":
            if time.time() > deadline:
                raise RuntimeError(
                    f"the cluster did not come up: sinfo says {self.query(['sinfo', '-h'])!r}; logs in {d}/log"
                )
            time.sleep(0.5)

    def _run(self, cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, env=self.env, capture_output=True, timeout=60)

    def query(self, cmd: list[str]) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30).stdout.strip()

    def stop(self) -> None:
        """Stop every daemon by its pid (slurmd first, munge last), waiting for each to exit."""
        for pid_file in reversed(self.pid_files):
            try:
                with open(pid_file) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)

    def submit(self, args: list[str], cwd: str, env: dict) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            cwd=cwd,
            env={**env, "SLURM_CONF": self.conf},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return out.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, ...), '' once it has left the controller."""
        return self.query(["squeue", "-h", "-j", job, "-o", "%T"])

    def wait_done(self, job: str, timeout: float) -> None:
        """Until the job has ended for good: a final state on two polls 3 s apart (a job that requeues itself
        passes through its end before it is queued again), or gone from the controller."""
        deadline, final = time.time() + timeout, 0
        while time.time() < deadline:
            state = self.state(job)
            final = final + 1 if state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else 0
            if final == 2:
                return
            time.sleep(3 if final else 1)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:.0f} s")

    def signal_batch(self, job: str, sig: str) -> None:
        """Send sig to the job's batch shell only (what --signal=B:USR1@N does near the time limit)."""
        subprocess.run(["scancel", "-b", f"--signal={sig}", job], env=self.env, check=True, timeout=30)

    def cancel(self, job: str) -> None:
        """What a user's `scancel JOB` does: SIGTERM to every step and the batch shell, then Slurm ends the job."""
        subprocess.run(["scancel", job], env=self.env, check=True, timeout=30)
