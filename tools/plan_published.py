"""The planner against published throughput: Megatron-LM's A100 runs (predicted vs published per row, and the layout
the planner picks for each; megatron_lite/plan/published.py has the sources and the systems), and MosaicML's H100
and A100 runs of fully sharded data parallelism (plan/published_fsdp.py), priced at each GPU's rates.

    python tools/plan_published.py --out bench/results/plan_published.md     # about 3 minutes on one core
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from megatron_lite.plan.published import KORTHIKANTI_2022, NARAYANAN_2021, row
    from tools.commit import git_commit

    lines = [
        "# Planner vs published Megatron-LM throughput (tools/plan_published.py)",
        "",
        f"- Date {datetime.date.today().isoformat()}, commit `{git_commit()}`; cluster.achievable = 0.65; "
        "A100-80GB, 8 per node, NVLink 300 GB/s, 8 x 200 Gb/s HDR per node.",
        "- predicted: the paper's layout priced as the paper's system ran it, in the paper's convention "
        "(TFLOP/s per GPU for Narayanan 2021, MFU for Korthikanti 2022). ours at theirs / picked: the step "
        "time megatron_lite is predicted to take at the paper's layout and at the layout the planner picks "
        "(`train.py --plan`).",
        "",
        "| source | model | GPUs | their layout | published | predicted | error | ours at theirs s | picked layout "
        "| picked s | picked GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in NARAYANAN_2021 + KORTHIKANTI_2022:
        r = row(run)
        fmt = (lambda v: f"{v:.0f}") if run.recompute == "full" else (lambda v: f"{100 * v:.1f}%")
        lines.append(
            f"| {r['source']} | {r['model']} | {r['gpus']:,} | `{r['layout']}` | {fmt(r['published'])} | "
            f"{fmt(r['predicted'])} | {100 * r['error']:+.1f}% | {r['ours_at_theirs_s']:.2f} | "
            f"`{r['picked']}` | {r['picked_s']:.2f} | {r['picked_gib']:.1f} |"
        )
        print(lines[-1], flush=True)
    lines += fsdp_lines()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def fsdp_lines() -> list[str]:
    """MosaicML's FSDP rows on H100 and A100: their layouts (ZeRO-3 over every GPU), tokens/s per GPU published and
    predicted, and the H100/A100 ratio at the layouts both tables ran."""
    from megatron_lite.plan.published_fsdp import MOSAIC_A100, MOSAIC_H100, SOURCE, fsdp_row, same_layout_ratios

    lines = [
        "",
        f"## {SOURCE}",
        "",
        "Their layouts priced with each GPU's rates (plan/hardware.py: the H100's measured on this trainer in 2025, "
        "the A100's fitted to Megatron-LM's runs, not to these) and ZeRO-3's collectives as FSDP runs them (a gather "
        "per block each way, a reduce-scatter per block), overlapped with compute.",
        "",
        "| GPU | model | GPUs | their layout | tokens/s/GPU published | predicted | error | fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in MOSAIC_H100 + MOSAIC_A100:
        r = fsdp_row(run)
        lines.append(
            f"| {r['gpu']} | {r['model']} | {r['gpus']} | `{r['layout']}` | {r['published']:,.0f} | "
            f"{r['predicted']:,.0f} | {100 * r['error']:+.1f}% | {r['fits']} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Their stack on the H100 against the A100-80GB, at the same model, GPUs, micro-batch and recomputation "
        "(the dense bf16 peaks differ 3.17x):",
        "",
        "| model | GPUs | micro-batch | published H100/A100 | predicted H100/A100 |",
        "|---|---|---|---|---|",
    ]
    for h, _, published, predicted in same_layout_ratios():
        lines.append(f"| mpt-{h.model_name} | {h.gpus} | {h.micro_batch} | {published:.2f}x | {predicted:.2f}x |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
