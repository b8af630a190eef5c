"""How the row-wise norm kernels (rmsnorm, layernorm) lay a (rows, N) problem over Triton programs: a whole
row per tile, several rows per program when rows are narrow, and a capped backward grid whose per-program
gain/bias partial sums torch adds up in a fixed order."""

from __future__ import annotations

import torch
import triton

MAX_BLOCK_N = 65536  # widest row held in one tile (64K fp32 registers spread over a program on a GPU)
TILE_ELEMENTS = 8192  # rows per program = TILE_ELEMENTS / padded row width, between 1 and MAX_ROWS
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
    return rows, block_n, min(16, max(4, rows * block_n // 1024))  # 8 warps for an 8192-element tile
