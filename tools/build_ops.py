"""Build DeepSpeed's CPU ops ahead of the first run that needs them (`make ops`; `make test` builds two of them).

On a CPU machine DeepSpeed compiles three C++ ops just in time, each on the first run that loads it: the
shared-memory communication op (every run), CPU Adam (zero.offload_optimizer=cpu or nvme) and async I/O (NVMe
offload; needs libaio). They take about one, two and seven minutes on two cores, which would otherwise land in
whichever test or training run comes first. The builds go to torch's extension cache (TORCH_EXTENSIONS_DIR, by
default ~/.cache/torch_extensions), where every later run loads them in a second; a second call finds them there.
Elsewhere (a CUDA machine) DeepSpeed's ops are not ours to build: it says so and does nothing.

    python tools/build_ops.py                          # all three
    python tools/build_ops.py --idle AsyncIOBuilder    # one, on the cores' idle time only

--idle puts the build under Linux's SCHED_IDLE policy (inherited by ninja and the compilers): it runs only when a
core has nothing else to do. The test session builds the async I/O op that way beside the first tests
(tests/conftest.py). SIGTERM stops a build cleanly: the compilers stop with it (ninja starts each in a process
group of its own, so they would otherwise run on to the end of their files, orphaned) and torch's build lock is
released, so a later run does not wait on it forever; the lock of a build killed outright (SIGKILL) is found and
removed first (megatron_lite/engine/build_locks.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def _stop(signum, frame):
    from megatron_lite.engine.build_locks import descendants

    for pid in descendants(os.getpid()):  # ninja and its compile jobs, before ninja's end orphans the jobs
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    raise SystemExit(128 + signum)  # unwinds torch's build, whose `finally` removes its lock file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"which ops to build, of {', '.join(OPS)} (default: all)")
    parser.add_argument("--idle", action="store_true", help="build on idle CPU time only (Linux SCHED_IDLE)")
    args = parser.parse_args(argv)
    for name in set(args.ops) - set(OPS):
        parser.error(f"unknown op {name!r}: choose from {', '.join(OPS)}")
    signal.signal(signal.SIGTERM, _stop)
    if args.idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    from deepspeed.accelerator import get_accelerator

    from megatron_lite.engine.build_locks import clear_stale_build_locks

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        print(f"build_ops: DeepSpeed's accelerator is {accelerator.device_name()}, not cpu; nothing to build")
        return 0
    clear_stale_build_locks(say=lambda line: print(f"build_ops: {line}", flush=True))
    for name in args.ops or OPS:
        builder = accelerator.create_op_builder(name)
        if not builder.is_compatible(verbose=False):
            print(f"build_ops: {name} cannot build here (for AsyncIOBuilder: libaio missing); skipped")
            continue
        t0 = time.perf_counter()
        builder.load(verbose=False)
        print(f"build_ops: {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
