"""Build DeepSpeed's CPU ops ahead of the first run that needs them (`make ops`, which `make test` runs).

On a CPU machine DeepSpeed compiles three C++ ops just in time, each on the first run that loads it: the
shared-memory communication op (every run), CPU Adam (zero.offload_optimizer=cpu or nvme) and async I/O (NVMe
offload; needs libaio). Each takes one to three minutes on two cores, which would otherwise land in whichever
test or training run comes first. The builds go to torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), where every later run loads them in a second; a second call finds them there.
Elsewhere (a CUDA machine) DeepSpeed's ops are not ours to build: it says so and does nothing.
"""

from __future__ import annotations

import time

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        print(f"build_ops: DeepSpeed's accelerator is {accelerator.device_name()}, not cpu; nothing to build")
        return 0
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if not builder.is_compatible(verbose=False):
            print(f"build_ops: {name} cannot build here (for AsyncIOBuilder: libaio missing); skipped")
            continue
        t0 = time.perf_counter()
        builder.load(verbose=False)
        print(f"build_ops: {name} ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
