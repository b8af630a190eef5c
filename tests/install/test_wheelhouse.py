"""The offline install: `make wheelhouse` on a machine with the package index, then `make install` on a clean
clone with the network unreachable, as on an offline GPU node. Torch is the one package the node brings itself
(here: this environment's torch and its own requirements, linked into a fresh virtual environment).

The steps run in tests/install/offline_install.py, which the session starts in the background on the cores' idle
time (the `offline_install` fixture, tests/conftest.py); this test, moved to the session's end, checks each step."""

import os
import re

import pytest

pytestmark = pytest.mark.slow


def _ran(done: dict, name: str) -> dict:
    """The step called `name`, which must have run and exited 0."""
    ran = {s["step"]: s for s in done["steps"]}
    assert name in ran, f"the step {name!r} did not run; the last was {done['steps'][-1]['step']!r}"
    step = ran[name]
    assert step["returncode"] == 0, f"{name} exited {step['returncode']}:\n{step['stdout'][-2000:]}\n{step['stderr']}"
    return step


def test_offline_install_from_a_wheelhouse(offline_install):
    _ran(offline_install, "wheelhouse")
    wheels = os.listdir(offline_install["wheelhouse"])
    assert any(w.startswith("deepspeed-") and w.endswith("-none-any.whl") for w in wheels), wheels
    # the node's own torch and what it requires (torchao, torch's sibling on PyPI, is one of ours)
    assert not any(re.match(r"(torch|triton)-|nvidia_", w) for w in wheels), wheels
    assert any(w.startswith("torchao-") for w in wheels), wheels
    _ran(offline_install, "make install")
    imported = _ran(offline_install, "import")["stdout"].strip().splitlines()[-1]
    assert imported.startswith(offline_install["clone"]), imported  # the clone's code, installed editable
    gpu = _ran(offline_install, "make bench-gpu")
    assert "no CUDA device" in gpu["stdout"], gpu["stdout"] + gpu["stderr"][-2000:]
