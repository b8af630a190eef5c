"""tools/bench_pipeline.py's timeline pictures: a schedule as the executor ran it, over the simulator's."""

from __future__ import annotations

from megatron_lite.pipeline.simulate import label


def plot_timeline(row: dict, path: str, pp: int) -> None:
    """Executed timeline (top) over the simulator's (bottom): a row per rank, forwards blue, backwards red,
    chunk 1 lighter; each box names its micro-batch (and chunk a/b when vpp > 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colour = {
        ("F", 0): "#1f5fa8",
        ("F", 1): "#8fbbe6",
        ("B", 0): "#c0392b",
        ("B", 1): "#f1a79c",
        ("W", 0): "#2e8b57",
        ("W", 1): "#9fd8b5",
    }
    kinds = [k for k in "FBW" if any(e[2] == k for tl in row["timelines"] for e in tl)]
    vpp, panels = (
        row["vpp"],
        (
            ("executed (gloo, sleep-based chunks)", row["timelines"]),
            ("simulated (same costs, free messages)", row["sim_timelines"]),
        ),
    )
    fig, axes = plt.subplots(2, 1, figsize=(15, 5.6), sharex=True)
    for ax, (title, timelines) in zip(axes, panels):
        for rank, tl in enumerate(timelines):
            for start, end, kind, mb, chunk in tl:
                s, w = start * 1e3, (end - start) * 1e3
                ax.barh(rank, w, left=s, height=0.8, color=colour[(kind, chunk)], edgecolor="white", lw=0.5)
                ax.text(
                    s + w / 2,
                    rank,
                    label("", mb, chunk, vpp),
                    ha="center",
                    va="center",
                    fontsize=6.5 if vpp == 1 else 5.5,
                    color="white" if chunk == 0 else "black",
                )
        ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[1].set_xlabel("time since the first forward starts (ms)")
    names = {"F": "forward", "B": "input gradient (B)" if "W" in kinds else "backward", "W": "weight gradient (W)"}
    handles = [
        Patch(color=colour[(k, c)], label=names[k] + (f" chunk {c} ({'ab'[c]})" if vpp > 1 else ""))
        for k in kinds
        for c in range(vpp)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    costs = (
        f"F={row['f_chunk_ms']:.0f} ms, B=W={row['b_chunk_ms'] / 2:.0f} ms"
        if "W" in kinds
        else f"F={row['f_chunk_ms']:.0f} ms, B={row['b_chunk_ms']:.0f} ms"
    )
    fig.suptitle(
        f"pp={pp} m={row['m']} {row['schedule']} vpp={vpp}: bubble measured {row['measured']:.3f}, "
        f"simulated {row['theory']:.3f}  ({costs} per chunk)",
        x=0.01,
        ha="left",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    fig.savefig(path, dpi=130)
    plt.close(fig)
