"""torchrun's entry for a pool world (tests/distributed/pool.py): wait for request <k>.json in the inbox (argv[1]),
train the spec it names as tests/distributed/worker.py does, answer <k>.done (rank 0) or <k>.error.<rank>, and
wait for request k + 1. A failed request ends the world: a rank that raised may have left the others inside a
collective, so it exits and torchrun stops the rest."""

import json
import os
import sys
import time
import traceback

import torch.distributed as dist

from megatron_lite.cli import exit_process
from tests.distributed.pool import POLL_S
from tests.distributed.worker import train_spec


def serve(inbox: str, client: int) -> int:
    """client: the pid of the pytest process that owns the pool; the world ends if it is gone (killed)."""
    rank = int(os.environ["RANK"])
    with open(os.path.join(inbox, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    k = 0
    while True:
        request = os.path.join(inbox, f"{k}.json")
        polls = 0
        while not os.path.exists(request):
            time.sleep(POLL_S)
            polls += 1
            if polls % 50 == 0 and not _alive(client):  # once a second
                os._exit(1)
        with open(request) as f:
            spec = json.load(f)
        if spec.get("stop"):
            break
        try:
            train_spec(spec["spec"])  # ends with a barrier
        except BaseException:
            with open(os.path.join(inbox, f"{k}.error.{rank}"), "w") as f:
                f.write(traceback.format_exc())
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        if rank == 0:
            open(os.path.join(inbox, f"{k}.done"), "w").close()
        k += 1
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    exit_process(lambda: serve(sys.argv[1], int(sys.argv[2])))
