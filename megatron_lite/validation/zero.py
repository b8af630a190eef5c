"""zero.*: the ZeRO stage, offload and its NVMe directory, whether this machine can offload to NVMe, hpZ and hybrid
sharding (shard_size)."""

from __future__ import annotations

from megatron_lite.config import Config, ZeroConfig
from megatron_lite.errors import ConfigError
from megatron_lite.validation.rules import choice, fail, writable


def check_zero(z: ZeroConfig) -> None:
    choice("zero.stage", z.stage, (0, 1, 2, 3))
    choice("zero.offload_optimizer", z.offload_optimizer, ("none", "cpu", "nvme"))
    choice("zero.offload_param", z.offload_param, ("none", "cpu", "nvme"))
    if z.offload_optimizer != "none" and z.stage == 0:
        fail("zero.offload_optimizer", z.offload_optimizer, "needs zero.stage >= 1", "set zero.stage=1, 2 or 3")
    if z.offload_param != "none" and z.stage != 3:
        fail(
            "zero.offload_param",
            z.offload_param,
            f"needs zero.stage=3 (got {z.stage})",
            "set zero.stage=3 or zero.offload_param=none",
        )
    if z.offload_optimizer == "nvme" and z.stage != 3:  # DeepSpeed's ZeRO-1/2 take any device as CPU, silently
        fail(
            "zero.offload_optimizer",
            "nvme",
            f"needs zero.stage=3 (got {z.stage}: DeepSpeed's ZeRO-1 and -2 offload the optimizer to CPU memory only)",
            "set zero.stage=3, or zero.offload_optimizer=cpu",
        )
    if "nvme" in (z.offload_optimizer, z.offload_param):
        if not z.nvme_path:
            fail(
                "zero.nvme_path",
                repr(z.nvme_path),
                "is empty (the swap files would go to the working directory)",
                "give the NVMe directory, e.g. zero.nvme_path=/local_nvme/swap",
            )
        writable("zero.nvme_path", z.nvme_path)


def check_offload_support(cfg: Config) -> None:
    """NVMe offload needs DeepSpeed's async-io op; say so before any process group starts."""
    z = cfg.zero
    if "nvme" in (z.offload_optimizer, z.offload_param):
        from megatron_lite.engine.ds_config import async_io_available

        if not async_io_available():
            key = "zero.offload_optimizer" if z.offload_optimizer == "nvme" else "zero.offload_param"
            raise ConfigError(
                f"{key}=nvme needs DeepSpeed's async_io op, which cannot build here (libaio missing); "
                "install libaio-dev (apt) or use cpu offload"
            )


def check_hpz(cfg: Config, dp: int) -> None:
    """zero.hpz: a group size of the ZeRO ranks (dp x cp), at stage 3."""
    z, partitions = cfg.zero, dp * cfg.parallel.cp
    if z.hpz == 1:
        return
    if z.hpz < 1:
        fail("zero.hpz", z.hpz, "must be >= 1 (ranks in a secondary-shard group)", "use 1 to turn hpZ off")
    if z.stage != 3:
        fail(
            "zero.hpz",
            z.hpz,
            f"needs zero.stage=3 (got {z.stage}: hpZ shards parameters)",
            "set zero.stage=3 or zero.hpz=1",
        )
    if partitions % z.hpz:
        divisors = ", ".join(str(d) for d in range(1, partitions + 1) if partitions % d == 0)
        fail(
            "zero.hpz",
            z.hpz,
            f"must divide the {partitions} ZeRO ranks (dp={dp} x cp={cfg.parallel.cp}) into groups",
            f"use one of {divisors}",
        )


def check_shard_size(cfg: Config, dp: int) -> None:
    """zero.shard_size: dp ranks per ZeRO partition group (HSDP), dividing dp, at stages 1-3, without hpZ, and
    with optimizer offload at stage 3 only."""
    z = cfg.zero
    size = z.shard_size
    if size is None:
        return
    if size < 1:
        fail(
            "zero.shard_size",
            size,
            "must be >= 1 (data-parallel ranks per ZeRO group)",
            "use null to shard over all dp",
        )
    if z.stage == 0:
        fail(
            "zero.shard_size",
            size,
            "needs zero.stage >= 1 (ZeRO-0 shards nothing, every dp rank holds all states)",
            "set zero.stage=1, 2 or 3, or zero.shard_size=null",
        )
    if dp % size:
        divisors = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        fail("zero.shard_size", size, f"must divide dp={dp} into groups of replicas", f"use one of {divisors}")
    if size == dp:
        return  # one group: plain ZeRO
    if z.hpz > 1:
        fail(
            "zero.shard_size",
            size,
            f"and zero.hpz={z.hpz} both keep ZeRO-3's gathers inside a group of ranks; they do not compose here",
            "use one: zero.hpz=1 or zero.shard_size=null",
        )
    if z.offload_optimizer != "none" and z.stage < 3:
        fail(
            "zero.shard_size",
            size,
            f"with zero.offload_optimizer={z.offload_optimizer} at zero.stage={z.stage}: DeepSpeed's ZeRO-1/2 offload "
            "measures each gradient as it copies it to the host in backward, before the replicas average them",
            "set zero.stage=3 (its offload copies at the step), zero.offload_optimizer=none or zero.shard_size=null",
        )
