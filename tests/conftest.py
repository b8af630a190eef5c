"""Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton
is first imported (DeepSpeed imports it too), so it is set here, ahead of every test module."""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
