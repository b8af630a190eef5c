"""requirements.lock and what `make install` made of it, and Hugging Face's `kernels` package beside ours.

transformers 5.25 made Hugging Face's `kernels` package a requirement of its own. Our Triton kernels were then a
top-level `kernels` package too: from the repository's root ours shadowed theirs, from tools/ theirs shadowed ours,
and a fresh clone's `make test` stopped at its first step. The install also took whatever was newest on the day.
So: the lock pins every package (and names every one megatron_lite needs), the environment holds exactly its
versions, and from the root, tools/ and tests/ one process imports transformers' hub-kernels integration with
their `kernels` and runs one of our fused kernels against its torch reference."""

import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tools import lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_environment_holds_exactly_the_locks_versions(tmp_path, capsys):
    """What tools/lock.py makes of the lock for this machine's torch, then every pin against what is installed."""
    pins = tmp_path / "constraints.txt"
    lock.constraints(str(pins))
    assert lock.check(str(pins)) == 0, capsys.readouterr()
    assert set(lock.read(str(pins))) == set(lock.read()) - {"torch"}, capsys.readouterr().out  # nothing dropped here


def test_the_lock_names_every_package_megatron_lite_needs():
    """megatron_lite[dev]'s requirements, transitively as installed here (markers evaluated), are all in the lock:
    a dependency added to pyproject.toml without `make lock` fails here, before it fails on a fresh clone."""
    pinned = lock.read()
    missing = lock.closure("megatron_lite", ("dev",)) - set(pinned) - {"megatron-lite"}
    assert not missing, f"not in requirements.lock: {sorted(missing)}; run `make lock`"
    assert {"setuptools", "packaging", "torch"} <= set(pinned)


def test_a_machines_own_torch_keeps_what_it_pins(tmp_path, monkeypatch, capsys):
    """A CUDA build of torch pins its triton exactly: where the lock's triton differs, that pin gives way to torch's
    and is said; pins that torch's ranges admit stay; torch itself is never pinned over the machine's."""
    lock_file = tmp_path / "requirements.lock"
    lock_file.write_text("# a lock\ntorch==2.13.0\ntriton==3.9.0\nsympy==1.14.0\nrich==15.0.0\n")
    monkeypatch.setattr(lock, "LOCK", str(lock_file))
    monkeypatch.setattr(lock, "requirements", lambda name: [Requirement("triton==3.7.1"), Requirement("sympy>=1.13.3")])
    lock.constraints(str(tmp_path / "pins.txt"))
    assert lock.read(str(tmp_path / "pins.txt")) == {"sympy": "1.14.0", "rich": "15.0.0"}
    said = capsys.readouterr().out
    assert "triton==3.9.0 is not pinned: this machine's torch" in said and "requires triton==3.7.1" in said, said


def test_a_line_that_is_not_a_pin_is_refused(tmp_path):
    bad = tmp_path / "requirements.lock"
    bad.write_text("rich>=13\n")
    with pytest.raises(SystemExit, match=r"requirements.lock:1: 'rich>=13' is not name==version; .*make lock"):
        lock.read(str(bad))


# transformers' integration imports theirs at import time (and fails if `kernels` is ours); then one fused kernel of
# ours, in Triton's interpreter on CPU, against its torch reference.
BOTH = """
import os, importlib.metadata, torch
import kernels
from transformers.integrations import hub_kernels
from transformers.utils.import_utils import is_kernels_available
from megatron_lite.kernels import ops
assert is_kernels_available() and hub_kernels.get_kernel_hub is kernels.get_kernel
assert kernels.__version__ == importlib.metadata.version("kernels"), kernels.__version__
assert os.path.basename(os.path.dirname(os.path.dirname(kernels.__file__))) == "site-packages", kernels.__file__
x, w = torch.randn(5, 48), torch.randn(48)
fused, reference = ops.rms_norm(x, w, 1e-5, backend="triton"), ops.rms_norm(x, w, 1e-5, backend="torch")
assert (fused - reference).abs().max() <= 1e-5 * reference.abs().max(), (fused - reference).abs().max()
print("theirs:", kernels.__file__, "ours:", ops.__file__)
"""


@pytest.mark.parametrize("where", [".", "tools", "tests"])
def test_hugging_faces_kernels_and_ours_in_one_process(where):
    """From the root, tools/ and tests/ as the process's first path (as a script there has it)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    got = subprocess.run(
        [sys.executable, "-c", BOTH],
        cwd=os.path.join(ROOT, where),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    ours = got.stdout.split()[3]
    assert ours.startswith(os.path.join(ROOT, "megatron_lite", "kernels")), got.stdout
