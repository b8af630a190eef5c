"""Hybrid sharding (zero.shard_size): ZeRO within groups of dp ranks, replicas across them, against the single
process with the same weights, at the tolerances of test_zero.py (fp32, 6 steps: 1e-4 absolute on the losses, 1e-4
relative on the gradient norms); then its checkpoints, written once per replica group, and resumed at its own layout
and at others.

Without the replicas' gradient average (engine/repairs/hybrid.py) each replica steps on its own half of the batch:
measured at dp 4 in groups of 2, losses 0.13 off the single process's by step 6 and gradient norms 1.38 (relative).
"""

import os

from megatron_lite.checkpoint.store import step_name
from tests.distributed.common import overrides
from tests.distributed.launcher import ROOT, run_configs
from tests.distributed.test_precision import BF16, LOSS_TOL, NORM_TOL, assert_close
from tests.distributed.test_resume import STEPS8, assert_continues
from tests.distributed.test_zero import WIDER, assert_follows

# Every case on 4 ranks: dp 4 in groups of 2 on each stage; and groups of one dp rank beside tp 2 (with sp), cp 2
# and an interleaved pipeline, where the groups sit inside the dp group and the replicas average over it.
CASES = {
    "z1_shard2": ["zero.stage=1", "zero.shard_size=2"],
    "z2_shard2": ["zero.stage=2", "zero.shard_size=2"],
    "z3_shard2": ["zero.stage=3", "zero.shard_size=2"],
    "z3_shard2_offload": ["zero.stage=3", "zero.shard_size=2", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],
    "tp2_sp_z3_shard1": ["zero.stage=3", "zero.shard_size=1", "parallel.tp=2", "parallel.sp=true"],
    "cp2_z3_shard1": ["zero.stage=3", "zero.shard_size=1", "parallel.cp=2"],
    "pp2_vpp2_z2_shard1": ["zero.stage=2", "zero.shard_size=1", "parallel.pp=2", "parallel.vpp=2"],
}


def test_hybrid_sharding_matches_single_process(tmp_path):
    """Each case of CASES follows the single process; and ZeRO-1 in bf16 (DeepSpeed's BF16 optimizer, which keeps
    whole gradients) follows plain bf16 ZeRO-1 at test_precision.py's tolerances."""
    (single,) = run_configs(1, [overrides(tmp_path, "single", *WIDER)], tmp_path)
    runs = [overrides(tmp_path, name, *extra, *WIDER) for name, extra in CASES.items()]
    runs += [
        overrides(tmp_path, "bf16_z1", BF16, "zero.stage=1", "train.steps=4"),
        overrides(tmp_path, "bf16_z1_shard2", BF16, "zero.stage=1", "zero.shard_size=2", "train.steps=4"),
    ]
    *results, bf16, bf16_hybrid = run_configs(4, runs, tmp_path)
    for name, result in zip(CASES, results):
        assert_follows(result, single, name)
    assert_close(bf16_hybrid, bf16, "bf16 ZeRO-1 shard_size=2 vs shard_size=null", LOSS_TOL, NORM_TOL)


WRITES_WORKER = os.path.join(ROOT, "tests", "distributed", "checkpoint_writes_worker.py")


def _deepspeed_files(writes: list[list[str]]) -> list[list[str]]:
    """Each rank's DeepSpeed files (its model and ZeRO states) of checkpoint_writes_worker.py's record."""
    return [sorted(f for f in files if f.endswith("_states.pt")) for files in writes]


def test_hybrid_sharding_checkpoints_once_per_replica_and_resumes(tmp_path):
    """ZeRO-2 and ZeRO-3 at dp 4 in groups of 2 save at step 4 of 8: the first replica's two ranks write DeepSpeed's
    files, the second's none (it holds the same states under the same names: checkpoint_writes_worker.py records who
    wrote what). Resumed at their own layout they continue exactly (1e-6); at dp 2 without
    hybrid sharding (the same 2 partitions: DeepSpeed's own load) and at dp 4 without it (4 partitions: through the
    universal form) within 1e-4; and a plain dp-4 checkpoint resumes in groups of 2 within 1e-4."""
    hybrid = {stage: [f"zero.stage={stage}", "zero.shard_size=2", *WIDER, *STEPS8] for stage in (2, 3)}
    plain = ["zero.stage=2", *WIDER, *STEPS8]
    saving = ["checkpoint.interval=4"]
    straight = run_configs(
        4,
        [overrides(tmp_path, f"z{s}", *hybrid[s], *saving) for s in (2, 3)]
        + [overrides(tmp_path, "plain", *plain, *saving)],
        tmp_path,
        worker=WRITES_WORKER,
    )
    z2, z3, flat = straight
    for result, what in ((z2, "ZeRO-2"), (z3, "ZeRO-3")):  # dp ranks 2 and 3 are the second replica
        files = _deepspeed_files(result["checkpoint_writes"])
        first, second = files[:2], files[2:]
        assert all(first) and second == [[], []], f"{what} shard_size=2: files written per rank {first + second}"
        assert len({f for files in first for f in files}) == sum(map(len, first)), f"{what}: a file written twice"
    assert all(_deepspeed_files(flat["checkpoint_writes"])), "plain ZeRO-2: every rank writes its partition"

    def resumed(name: str, source: str, *layout: str) -> list[str]:
        checkpoint = f"checkpoint.resume={tmp_path}/{source}/checkpoints/{step_name(4)}"
        return overrides(tmp_path, name, *layout, f"checkpoint.dir={tmp_path}/{name}_ckpt", checkpoint)

    same2, same3, onto_plain4, from_plain = run_configs(
        4,
        [
            resumed("z2_same", "z2", *hybrid[2]),
            resumed("z3_same", "z3", *hybrid[3]),
            resumed("z2_onto_plain", "z2", *plain),
            resumed("plain_onto_hybrid", "plain", *hybrid[2]),
        ],
        tmp_path,
    )
    assert_continues(same2, z2, 1e-6, "ZeRO-2 shard_size=2 resume at its layout")
    assert_continues(same3, z3, 1e-6, "ZeRO-3 shard_size=2 resume at its layout")
    assert_continues(onto_plain4, z2, 1e-4, "shard_size=2 -> null at dp 4 (universal form)")
    assert_continues(from_plain, flat, 1e-4, "shard_size=null -> 2 at dp 4 (universal form)")
    (onto_dp2,) = run_configs(2, [resumed("z2_dp2", "z2", *plain)], tmp_path)
    assert_continues(onto_dp2, z2, 1e-4, "shard_size=2 at dp 4 -> dp 2 (the same partitions)")
