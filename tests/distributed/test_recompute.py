"""Activation recomputation in real training: tp=2 x dp=2 with sequence parallelism and ZeRO-3, dropout 0.1.

`none`, `selective` and `full` (every layer, and every 2nd) must give bit-identical per-step losses and
gradient norms: the recomputed forward gets the forward's dropout keys, so it redraws its masks, and DeepSpeed
re-gathers ZeRO-3 parameters for the recomputation. Model- and layer-level exactness (every gradient) is in
tests/unit/test_recompute.py and tests/distributed/dropout_worker.py.
"""

from tests.distributed.common import overrides
from tests.distributed.launcher import run_configs


def test_recompute_modes_give_identical_training_with_dropout_tp_sp_zero3(tmp_path):
    layout = ["train.steps=4", "parallel.tp=2", "parallel.sp=true", "zero.stage=3", "model.dropout=0.1"]
    modes = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]
    runs = [
        overrides(tmp_path, f"{mode}{every}", *layout, f"train.recompute={mode}", f"train.recompute_every={every}")
        for mode, every in modes
    ]
    results = run_configs(4, runs, tmp_path)
    reference = results[0]
    assert len(reference["losses"]) == 4
    for (mode, every), result in zip(modes[1:], results[1:]):
        assert result["losses"] == reference["losses"], (mode, every, result["losses"], reference["losses"])
        assert result["grad_norms"] == reference["grad_norms"], (mode, every)
