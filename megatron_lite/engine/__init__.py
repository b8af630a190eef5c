"""Everything that talks to DeepSpeed, in one package (no module outside it imports deepspeed):

engine.py         Engine: one model replica's DeepSpeed engine plus the pipeline executor that runs its step, and
                  its saves and loads (DeepSpeed's own, the universal form's, an NVMe-swapped optimizer's)
ds_config.py      our config -> DeepSpeed's JSON config, parameter groups and TP split patterns; NVMe support
ds_checkpoint.py  DeepSpeed's checkpoint formats: staging for async saves, the universal form (conversion, reading)
zero_init.py      ZeRO-3 partitioning of each parameter as the model is built
build_locks.py    a killed op build's lock in torch's extension cache, removed before DeepSpeed loads its ops
repairs/          every DeepSpeed 0.19 workaround, each with its reason and the test that fails without it; the
                  only code that touches DeepSpeed's private attributes (our universal loaders, NVMe checkpoints)
"""

from megatron_lite.engine.engine import Engine, StepOutcome

__all__ = ["Engine", "StepOutcome"]
