"""Print a pipeline schedule as a rank x time grid, with its bubble and activation memory.

    python tools/show_schedule.py --pp 4 --vpp 2 --m 8                     # interleaved 1F1B
    python tools/show_schedule.py --pp 4 --m 8 --schedule gpipe --f-cost 1 --b-cost 2
    python tools/show_schedule.py --pp 4 --m 8 --schedule zbv                # vpp 2 implied; F, B and W

Runs megatron_lite.pipeline's simulator (no processes): `F3b` is the forward of micro-batch 3 through
chunk 1, `~` a computation still running, `.` an idle rank.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.pipeline.schedules import build_schedule, held_bound, in_flight_bound, resolve_schedule  # noqa: E402
from megatron_lite.pipeline.simulate import expected_bubble, render_grid, simulate  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--vpp", type=int, default=1, help="chunks per rank")
    p.add_argument("--m", type=int, required=True, help="micro-batches per step on each pipeline")
    p.add_argument(
        "--schedule", default="auto", help="auto, gpipe, 1f1b, interleaved, zb_h1 or zbv (as parallel.schedule)"
    )
    p.add_argument("--f-cost", "--f", type=float, default=1.0, help="time of one chunk forward")
    p.add_argument("--b-cost", "--b", type=float, default=2.0, help="time of one chunk backward (B + W)")
    p.add_argument("--w-cost", "--w", type=float, default=None, help="of which W, in zb_h1 / zbv (default: half)")
    a = p.parse_args(argv)
    vpp = 2 if a.schedule == "zbv" and a.vpp == 1 else a.vpp
    name = resolve_schedule(a.schedule, vpp)
    result = simulate(
        build_schedule(name, a.pp, vpp, a.m), a.pp, vpp, a.m, a.f_cost, a.b_cost, name=name, w_cost=a.w_cost
    )
    print(
        f"{name}: pp={a.pp} vpp={vpp} m={a.m} f={a.f_cost:g} b={a.b_cost:g}"
        + (f" (w={a.b_cost / 2 if a.w_cost is None else a.w_cost:g})" if name in ("zb_h1", "zbv") else "")
    )
    print(render_grid(result))
    print(
        f"makespan {result.makespan:g} (ideal {result.ideal:g}); bubble {result.bubble:.4f}, "
        f"formula {expected_bubble(name, a.pp, vpp, a.m, a.f_cost, a.b_cost, a.w_cost):.4f}"
    )
    bounds = [in_flight_bound(name, a.pp, vpp, a.m, r) for r in range(a.pp)]
    print(f"peak in-flight micro-batch chunks per rank {result.peak_in_flight} (bound {bounds})")
    if name in ("zb_h1", "zbv"):
        held = [held_bound(name, a.pp, vpp, a.m, r) for r in range(a.pp)]
        print(f"peak chunks awaiting their W per rank {result.peak_held} (bound {held})")


if __name__ == "__main__":
    main()
