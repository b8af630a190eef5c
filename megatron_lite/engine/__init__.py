"""Everything that talks to DeepSpeed, in one package:

engine.py       Engine: one model replica's DeepSpeed engine plus the pipeline executor that runs its step
ds_config.py    our config -> DeepSpeed's JSON config, parameter groups and TP split patterns; NVMe support
zero_init.py    ZeRO-3 partitioning of each parameter as the model is built
build_locks.py  a killed op build's lock in torch's extension cache, removed before DeepSpeed loads its ops
repairs.py      every DeepSpeed 0.19 workaround, each with its reason and the test that fails without it
"""

from megatron_lite.engine.engine import Engine, StepOutcome

__all__ = ["Engine", "StepOutcome"]
