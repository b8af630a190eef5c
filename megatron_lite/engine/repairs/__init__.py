"""Where DeepSpeed 0.19 (pinned < 0.20) does not do what we need, repaired in one place, each with its reason; the
only code that reaches into DeepSpeed's private attributes and methods.

  honour_explicit_zero3_dtype     zero.Init ignores an explicit dtype on the CPU accelerator (NVMe offload)
  reset_backward_hook_count       ZeRO expects a forward before every backward (1F1B's cool-down has none)
  zero_offload_accumulators       CPU offload expects every parameter in a step's first backward (pipelines)
  restore_group_hyperparameters   a load puts the saved optimizer's group hyperparameters in place of this run's
  replay_cpu_adam_beta_powers     a resumed CPU Adam computes beta^t afresh, not as the running product it kept
  sum_zero3_gradients_over_cp     ZeRO-3's reduce-scatter averages over the sequence-parallel (cp) ranks
  restore_functional_linear       zero.Init(module=...) leaves its own F.linear in torch for the process's life
  forget_run_in_deepspeed_globals DeepSpeed's module globals keep an ended run's model and process groups
  takes_output_backward           which of its optimizers take output.backward(grad) is said only in private
  use_hpz_group                   hpZ builds its groups over consecutive world ranks, ignoring the mpu's
  hybrid.py                       hybrid sharding, which it no longer has: the replicas' gradient average and
                                  checkpoint files
  universal_load.py               its loaders of the universal form cut TP shards and hyperparameters wrongly: ours
  nvme_checkpoint.py              its checkpoint of an optimizer swapped to NVMe saves the swapped states empty

Each is exercised by a test that fails without it (named in its docstring).
"""

from __future__ import annotations

import sys

import torch


def honour_explicit_zero3_dtype() -> None:
    """DeepSpeed 0.19's zero.Init ignores the dtype it is given when the accelerator reports no fp16 support
    (the CPU accelerator): `dtype or fp16 if fp16_supported() else bf16 if ...` parses as
    `(dtype or fp16) if ... else bf16`. With NVMe parameter offload the swap buffers then hold bf16, so every
    swapped (non-persistent) fp32 parameter comes back rounded to bf16 (measured: the tiny model's embedding,
    off by up to 2.4e-4 after engine init). Give an explicit dtype precedence, as intended."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "honours_dtype", False):
        return

    def set_dtype(self, ds_config, dtype):
        if dtype is not None:
            self.dtype = dtype
        else:
            original(self, ds_config, dtype)

    set_dtype.honours_dtype = True
    Init._set_dtype = set_dtype


def reset_backward_hook_count(optimizer) -> None:
    """DeepSpeed's ZeRO optimizers count gradient hooks per backward and reset the count in the engine's
    forward, assuming a forward before every backward. 1F1B's cool-down runs backwards back to back (and the
    tied-embedding sync runs one more), so reset it before each backward as that forward would; otherwise the
    count runs past the end, the reduction epilogue never runs and ZeRO-2 loses gradients
    (tests/distributed/test_pipeline.py, ZeRO-2 runs)."""
    optimizer.clear_backward_seen_flag()


def zero_offload_accumulators(optimizer) -> None:
    """With CPU optimizer offload, ZeRO 1/2 copy a parameter's gradient into its CPU accumulator in the step's
    first backward and add to it afterwards, assuming every parameter takes part in the first backward. Under a
    pipeline many do not (a later chunk's first backward, the tied-embedding sync), and they would add onto the
    previous step's gradient. Zeroed buffers make copy and add agree (test_pipeline.py, the offload run)."""
    for buffer in getattr(optimizer, "accumulated_grads_in_cpu", {}).values():
        buffer.zero_()


def sum_zero3_gradients_over_cp(optimizer, cp_size: int) -> None:
    """With its sequence-parallel hooks (our cp group, parallel/context.py) DeepSpeed reduces gradients over
    dp x cp, summing over cp and averaging over dp: ZeRO 0-2 and ZeRO-3's all-reduce path divide by
    (dp x cp) / cp. ZeRO-3's default reduce-scatter path (`__avg_scatter_grads`, through
    reduce_scatter_coalesced) divides by dp x cp instead, so its gradients come out cp times too small
    (measured at cp=2: half the gradient norm). Multiply that path's partitions by cp
    (tests/distributed/test_context_parallel.py, the ZeRO-3 trajectory)."""
    if cp_size == 1:
        return
    name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"  # the private method, as Python mangles it
    original = getattr(optimizer, name)

    def avg_scatter_grads(params, communication_data_type):
        return [partition.mul_(cp_size) for partition in original(params, communication_data_type)]

    setattr(optimizer, name, avg_scatter_grads)


def restore_group_hyperparameters(optimizer, hparams: list[dict]) -> None:
    """After a DeepSpeed 0.19 load (the same layout: another goes through our loaders, engine/repairs/universal_load.py)
    the groups' hyperparameters are the saved optimizer's: a checkpoint of torch's AdamW loaded into DeepSpeed's
    CPU Adam (CPU offload switched on at a resume) lacks its bias_correction, a KeyError at the first step. Put
    this run's back (test_resume.py: offload switched on)."""
    for group, saved in zip(optimizer.param_groups, hparams):
        group.update(saved)


def replay_cpu_adam_beta_powers(optimizer) -> None:
    """After a load into DeepSpeed's CPU Adam (CPU or NVMe optimizer offload). Its C++ object keeps beta1^t and
    beta2^t in float32, multiplied by beta once a step (cpu_adam.h IncrementStep); a fresh object meeting step t+1
    computes pow(beta, t+1) instead, which differs in the last bit at some t (beta2 = 0.95: t = 6-8, 10-12), so the
    first update after such a resume differed from the uninterrupted run's (measured: bf16 losses 1.7e-4 off by
    4 steps later; fp32 < 1e-6). Replaying steps 1..t with no elements leaves the object holding what the
    uninterrupted run's holds (a few microseconds a step). Without it tests/unit/test_repairs.py fails."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    adam = getattr(optimizer, "optimizer", optimizer)  # ZeRO's wrapper holds it
    if not isinstance(adam, DeepSpeedCPUAdam):  # (before reading steps: torch AdamW's are tensors, maybe on a GPU)
        return
    steps = [int(state["step"]) for state in adam.state.values() if "step" in state]
    if not steps:
        return
    group, empty = adam.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for step in range(1, max(steps) + 1):
        adam.ds_opt_adam.adam_update(
            adam.opt_id,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
            empty,
            empty,
            empty,
            empty,
        )


def restore_functional_linear() -> None:
    """Put torch.nn.functional.linear back when a run ends. deepspeed.zero.Init(module=...) (model/build.py
    zero3_partitioner, as DeepSpeed's own ZeRO-3 setup does) swaps in ZeRO-3's memory-efficient linear for the
    rest of the process ("This will persist unless manually reset"). Our linears call F.linear, so a later run
    in the same process (a test world, a tool that trains several layouts) computed with it too, in another
    rounding: a ZeRO-1 run after a ZeRO-3 one moved its losses in the 7th digit (tests/distributed/test_zero.py).
    A no-op where no ZeRO-3 run was."""
    zero3 = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero3, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def forget_run_in_deepspeed_globals(model: torch.nn.Module, ctx) -> None:
    """DeepSpeed keeps a run alive after its engine is destroyed: in module globals, the mpu
    (deepspeed.utils.groups.mpu, until the next engine replaces it) and, under ZeRO-3, the model at the bottom of
    its forward-module stack (each ZeRO-3 engine pushes its model and none pops it; blocks re-run by activation
    recompute stay on it too) and in the class-wide lru_cache of PartitionedParameterCoordinator.__params_to_release
    (keyed by coordinator and module); and its bf16 optimizer binds methods of each parameter to the parameter
    itself (get_full_hp_param, ...: link_hp_params) beside its data-parallel group, a cycle through the tensor that
    Python's collector does not break. Through them a process that trains again keeps every ended run's model,
    optimizer and process groups, and each gloo group's threads, which wake hundreds of times a second
    (tests/distributed/worker.py counts them)."""
    from deepspeed.utils import groups

    if getattr(groups.mpu, "ctx", None) is ctx:
        groups.mpu = None
    if ctx.hpz_group is not None and groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is ctx.hpz_group:
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # (DeepSpeed asserts it is unset before making its own)
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        mine = {id(m) for m in model.modules()}
        offload.FWD_MODULE_STACK[:] = [m for m in offload.FWD_MODULE_STACK if id(m) not in mine]
    for param in model.parameters():
        for name, value in list(vars(param).items()):
            if name == "_dp_group" or getattr(value, "__self__", None) is param:
                delattr(param, name)
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        method = vars(coordinator.PartitionedParameterCoordinator)
        method = method["_PartitionedParameterCoordinator__params_to_release"]
        for cell in method.__closure__ or ():  # under DeepSpeed's instrument_w_nvtx wrapper
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()


def takes_output_backward(ds_engine) -> bool:
    """Whether the engine's optimizer takes `output.backward(grad)` through the engine's forward (its hooks open
    and close each backward): DeepSpeed's ZeRO optimizers do, its plain ZeRO-0 one does not. DeepSpeed 0.19 says
    so only in a private attribute; Engine.__init__ checks it against the ZeRO stage."""
    return bool(ds_engine._support_torch_style_backward)


def use_hpz_group(group) -> None:
    """ZeRO++ hpZ (zero_hpz_partition_size) keeps a secondary shard of each parameter over a group of ranks that
    hold the same parameter. DeepSpeed 0.19 builds those groups over consecutive *world* ranks
    (groups._create_zero_param_parallel_group), ignoring the data-parallel group the mpu gives it: with tp, cp or
    pp > 1 consecutive ranks hold different TP shards or stages, so the backward would gather a mix of them. It
    takes the group from a module global when one is set (zero.Init, the ZeRO-3 optimizer and its offload all
    ask groups._get_zero_param_intra_parallel_group first), so ours (ParallelContext.hpz_group: hpz consecutive
    ranks of the dp x cp group) goes there. Measured with DeepSpeed's own groups at tp 2 x dp 2, d_model 256: the
    loss 0.027 off the single process's at step 1 and 0.20 at step 6, without a word; with ours equal to 1e-5
    (tests/distributed/test_zero.py's hpZ case)."""
    from deepspeed.utils import groups

    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group
