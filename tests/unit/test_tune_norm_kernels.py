"""tools/tune_norm_kernels.py on the CPU interpreter: every launch shape it sweeps (rows per program, warps,
backward grid cap) runs both norms forward and backward and agrees with the torch reference, and the module
knobs are restored afterwards. bf16 against the bf16 reference, relative to its largest value: a couple of
bf16 ulps (2^-8 each); measured at most 1.7e-2 (the interpreter truncates where torch rounds)."""

import os

import pytest

from megatron_lite.kernels import layernorm, rmsnorm, row_tiles

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_every_swept_configuration_is_right_and_the_knobs_come_back():
    from tools import tune_norm_kernels as tool

    before = (row_tiles.TILE_ELEMENTS, rmsnorm.MAX_BWD_PROGRAMS, layernorm.MAX_BWD_PROGRAMS)
    rows = tool.main(["--quick"])
    assert len(rows) == 2 * 2 * len(tool.TILES) * len(tool.PROGRAMS)  # widths x ops x configurations
    assert {r["rows_per_program"] for r in rows} >= {1, 2, 4, 8, 16}  # the sweep really changes the tile
    worst = max(rows, key=lambda r: r["error"])
    assert worst["error"] < 3e-2, worst
    assert (row_tiles.TILE_ELEMENTS, rmsnorm.MAX_BWD_PROGRAMS, layernorm.MAX_BWD_PROGRAMS) == before
