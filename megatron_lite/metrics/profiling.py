"""torch.profiler over chosen steps (train.profile_steps) on chosen ranks (train.profile_ranks).

Each profiled rank writes, when the last profiled step ends (or the run ends inside the window):

    ${run.dir}/profile/rank<R>_steps<a>-<b>.json.gz   a Chrome trace (chrome://tracing, Perfetto, TensorBoard)
    ${run.dir}/profile/rank<R>_steps<a>-<b>.txt       the ops averaged over the window: by GPU time (on a GPU),
                                                      then by CPU time

Each step is one `step <n>` range in the trace. As Megatron-LM's --profile-step-start/end and torchtitan's
profiling section, without a schedule's warm-up: pick steps after the first (start-up, compilation and
DeepSpeed's first-step allocations land there). Profiled steps run slower (the profiler records every op), so
their tokens/s and MFU are not the run's.
"""

from __future__ import annotations

import contextlib
import os

import torch


class StepProfiler:
    """Wraps each training step: starts torch.profiler at the window's first step, exports after its last."""

    def __init__(self, steps: list[int] | None, ranks: list[int], rank: int, run_dir: str, device: torch.device):
        self.first, self.last = steps if steps else (0, -1)
        self.enabled = steps is not None and rank in ranks
        self.rank, self.dir, self.cuda = rank, os.path.join(run_dir, "profile"), device.type == "cuda"
        self.prof, self.steps = None, []

    @contextlib.contextmanager
    def step(self, step: int):
        if not (self.enabled and self.first <= step <= self.last):
            yield
            return
        if self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities)
            self.prof.start()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if self.cuda:
            torch.cuda.synchronize()
        self.steps.append(step)
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (also when the run ended inside the window); then a no-op."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        if not self.steps:
            return
        os.makedirs(self.dir, exist_ok=True)
        base = os.path.join(self.dir, f"rank{self.rank}_steps{self.steps[0]}-{self.steps[-1]}")
        prof.export_chrome_trace(base + ".json.gz")
        events = prof.key_averages()
        with open(base + ".txt", "w") as f:
            if self.cuda:
                f.write(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
                f.write("\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        print(
            f"profile of steps {self.steps[0]}-{self.steps[-1]} on rank {self.rank}: {base}.json.gz (trace), "
            f"{base}.txt (ops)",
            flush=True,
        )
