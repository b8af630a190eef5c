"""How the row-wise norm kernels (rmsnorm, layernorm) lay a (rows, N) problem over Triton programs: a whole
row per tile, several rows per program when rows are narrow, and a capped backward grid whose per-program
gain/bias partial sums torch adds up in a fixed order."""

from __future__ import annotations

import torch
import triton

MAX_BLOCK_N = 65536  # widest row held in one tile (64K fp32 registers spread over a program on a GPU)
# Rows per program = TILE_ELEMENTS / padded row width, between 1 and MAX_ROWS. 4096 from tools/tune_norm_kernels.py
# on an H100 (bench/results/tune_norm_h100.json): of the 16 shapes swept, it had the least forward + backward time
# summed over both norms at widths 768, 2048 and 4096 (0.567 ms against 0.624 for the 8192 it replaced), and was
# within 2% of the best shape at each width; the forward did not depend on it.
TILE_ELEMENTS = 4096
MAX_ROWS = 16
MAX_BWD_PROGRAMS = 256  # backward programs; a fixed number keeps dw's summation order device-independent


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (rows, N) with unit column stride; a view when the layout allows, else a copy."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def row_tile(n_cols: int, op: str) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps) for rows of n_cols: a whole row per tile, several rows when narrow."""
    block_n = triton.next_power_of_2(n_cols)
    assert block_n <= MAX_BLOCK_N, f"{op} holds a row in one tile: N={n_cols} > {MAX_BLOCK_N}"
    rows = max(1, min(MAX_ROWS, TILE_ELEMENTS // block_n))
    return rows, block_n, min(16, max(4, rows * block_n // 1024))  # 4 warps up to a 4096-element tile
