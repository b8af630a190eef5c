"""Sweep the launch shape of the row-wise norm kernels (megatron_lite/kernels/: rmsnorm.py, layernorm.py) on a GPU.

    python tools/tune_norm_kernels.py --out bench/results/tune_norm_h100.json
    TRITON_INTERPRET=1 python tools/tune_norm_kernels.py --quick     # CPU: every configuration runs and is right

Two knobs, both in megatron_lite/kernels/row_tiles.py: TILE_ELEMENTS (elements per program's tile: rows per program =
TILE_ELEMENTS / padded row width, and num_warps follows the tile) and MAX_BWD_PROGRAMS (the backward's grid
cap: each program loops over row tiles and writes one row of fp32 gain/bias partial sums). More programs might
hide more of a loop iteration's load latency, at the cost of a larger partial buffer to sum; on an H100
(bench/results/tune_norm_h100.json) they did not, and a 4096-element tile beat the 8192 then in use.

Each configuration is timed forward and forward + backward in GPU time (tools/bench_kernels.gpu_timer: the
host kept ahead), bf16, 8192 rows of the widths of gpt2-124m, gpt-1.3b and llama-7b (768, 2048, 4096), and
checked against the torch reference (output and input gradient, relative to the reference's largest value).
The table gives GB/s against the device's copy bandwidth; the JSON keeps every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.kernels import layernorm, rmsnorm, row_tiles  # noqa: E402
from tools.bench_kernels import copy_bandwidth, gpu_timer, kernel_device, run_case, timer  # noqa: E402
from tools.commit import git_commit  # noqa: E402

TILES = (2048, 4096, 8192, 16384)
PROGRAMS = (256, 512, 1024, 2048)


def ops(n_rows: int, width: int, dtype, device):
    """(name, kernel, reference, inputs) for both norms at one shape."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=gen) + 0.5).to(device=device, dtype=dtype).requires_grad_(True)

    x, w, b = t(n_rows, width), t(width), t(width)
    yield "rmsnorm", rmsnorm.rms_norm_triton, rmsnorm.rms_norm_reference, (x, w, 1e-5)
    yield "layernorm", layernorm.layer_norm_triton, layernorm.layer_norm_reference, (x, w, b, 1e-5)


def worst_error(kernel, reference, inputs) -> float:
    """Largest |kernel - reference| over the output and d x, relative to the reference's largest value."""
    outs = []
    for fn in (kernel, reference):
        x = inputs[0].detach().clone().requires_grad_(True)
        out = fn(x, *inputs[1:])
        out.float().square().sum().backward()
        outs.append((out.detach().float(), x.grad.float()))
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*outs))


def configure(tile: int, programs: int) -> None:
    row_tiles.TILE_ELEMENTS = tile
    rmsnorm.MAX_BWD_PROGRAMS = layernorm.MAX_BWD_PROGRAMS = programs


def best_against_default(rows: list[dict], default: tuple[int, int]) -> list[tuple[str, int, dict, dict]]:
    """(op, width, the default configuration's row, the fastest row forward + backward) per op and width, in the
    order the sweep ran them."""
    found = []
    for key in dict.fromkeys((r["op"], r["width"]) for r in rows):
        mine = [r for r in rows if (r["op"], r["width"]) == key]
        now = next(r for r in mine if (r["tile_elements"], r["bwd_programs"]) == tuple(default))
        found.append((*key, now, min(mine, key=lambda r: r["fwd+bwd_ms"])))
    return found


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter: checks every configuration)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, quick = kernel_device("tune_norm_kernels", args.quick)
    n_rows, widths = (24, (200, 2000)) if quick else (8192, (768, 2048, 4096))
    dtype = torch.bfloat16
    if device.type == "cuda":
        measure = gpu_timer()
    else:  # the interpreter's times say nothing: run each case once, to check that it runs

        def measure(step):
            step()
            return float("nan")

    bandwidth = copy_bandwidth(device, timer(device)) if not quick else float("nan")
    default = (row_tiles.TILE_ELEMENTS, rmsnorm.MAX_BWD_PROGRAMS)
    e = torch.finfo(dtype).bits // 8
    rows = []
    try:
        for width in widths:
            for name, kernel, reference, inputs in ops(n_rows, width, dtype, device):
                nbytes = {"fwd": 2 * n_rows * width * e, "fwd+bwd": 5 * n_rows * width * e}
                for tile in TILES:
                    for programs in PROGRAMS:
                        configure(tile, programs)
                        per_row, _, warps = row_tiles.row_tile(width, name)
                        row = {
                            "op": name,
                            "width": width,
                            "tile_elements": tile,
                            "rows_per_program": per_row,
                            "num_warps": warps,
                            "bwd_programs": programs,
                            "error": worst_error(kernel, reference, inputs),
                        }
                        # the forward does not depend on the backward's grid: time it once per tile
                        phases = ("fwd", "fwd+bwd") if programs == PROGRAMS[0] else ("fwd+bwd",)
                        for phase in phases:
                            seconds = measure(run_case(kernel, inputs, phase == "fwd+bwd"))
                            row[f"{phase}_ms"] = 1e3 * seconds
                            row[f"{phase}_of_copy_bw"] = nbytes[phase] / seconds / bandwidth
                        rows.append(row)
                        print(
                            f"{name:<10} N={width:<5} tile {tile:>5} ({per_row:>2} rows, {warps:>2} warps) "
                            f"bwd programs {programs:>4}: "
                            + "  ".join(
                                f"{p} {row[p + '_ms']:.4f} ms ({100 * row[p + '_of_copy_bw']:.0f}%)" for p in phases
                            )
                            + f"  error {row['error']:.1e}",
                            flush=True,
                        )
    finally:
        configure(*default)
    for name, width, now, best in best_against_default(rows, default):
        print(
            f"best {name} N={width}: tile {best['tile_elements']}, bwd programs {best['bwd_programs']}: "
            f"fwd+bwd {best['fwd+bwd_ms']:.4f} ms against {now['fwd+bwd_ms']:.4f} ms now "
            f"(x{now['fwd+bwd_ms'] / best['fwd+bwd_ms']:.2f})"
        )
    worst = max(r["error"] for r in rows)
    print(f"largest relative error against the reference over every configuration: {worst:.1e}")
    if device.type == "cuda" and args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "bench": "tune_norm_kernels",
                    "device": torch.cuda.get_device_name(),
                    "dtype": "bf16",
                    "rows": n_rows,
                    "copy_GBps": bandwidth / 1e9,
                    "default": default,
                    "results": rows,
                    "commit": git_commit(),
                    "date": datetime.date.today().isoformat(),
                },
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
