"""The offline install: `make wheelhouse` on a machine with the package index, then `make install` on a clean
clone with the network unreachable, as on an offline GPU node. Torch is the one package the node brings itself
(here: this environment's torch and its own requirements, linked into a fresh virtual environment)."""

import os
import re
import subprocess
import sys
import venv
from importlib import metadata

import pytest

from tests.distributed.launcher import ROOT

pytestmark = pytest.mark.slow


def _requirement_closure(name: str) -> set[str]:
    """Distributions `name` needs at run time here (markers evaluated, extras ignored), itself included."""
    from packaging.requirements import Requirement

    seen, todo = set(), [name]
    while todo:
        dist = metadata.distribution(todo.pop())
        if dist.metadata["Name"] in seen:
            continue
        seen.add(dist.metadata["Name"])
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _link_torch(site: str) -> None:
    """Symlink torch, triton (a CUDA torch's requirement; the CPU build here lacks it), their requirements and
    dist-info into `site`: a GPU node's preinstalled torch stack."""
    os.makedirs(site)
    for name in _requirement_closure("torch") | _requirement_closure("triton"):
        dist = metadata.distribution(name)
        tops = (dist.read_text("top_level.txt") or "").split() or [re.sub(r"[-.]", "_", name).lower()]
        paths = {str(f).split("/")[0] for f in dist.files or []}
        for entry in paths & ({f for f in paths if f.endswith(".dist-info")} | set(tops) | {f"{t}.py" for t in tops}):
            src = dist.locate_file(entry)
            if os.path.exists(src) and not os.path.exists(os.path.join(site, entry)):
                os.symlink(src, os.path.join(site, entry))


def test_offline_install_from_a_wheelhouse(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    build = subprocess.run([sys.executable, "tools/wheelhouse.py", "--out", str(wheelhouse)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = os.listdir(wheelhouse)
    assert any(w.startswith("deepspeed-") and w.endswith("-none-any.whl") for w in wheels), wheels
    assert not any(re.match(r"(torch|triton|nvidia_)", w) for w in wheels), wheels

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", ROOT, str(clone)], check=True)
    os.symlink(wheelhouse, clone / "wheelhouse")
    venv.create(clone / ".venv", with_pip=True)  # no system site-packages: only torch is there beforehand
    py = clone / ".venv" / "bin" / "python"
    site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    _link_torch(str(tmp_path / "node_torch"))
    with open(os.path.join(site, "node_torch.pth"), "w") as f:
        f.write(str(tmp_path / "node_torch") + "\n")
    unreachable = "http://127.0.0.1:9"  # nothing listens there: any download fails at once
    env = dict(os.environ, PIP_NO_INDEX="1", http_proxy=unreachable, https_proxy=unreachable,
               HTTP_PROXY=unreachable, HTTPS_PROXY=unreachable, PIP_CONFIG_FILE=os.devnull)
    # `make test ARGS=...` passes its ARGS down: in MAKEFLAGS, and as an environment variable of its own (make
    # exports command-line variables), which `make bench-gpu` would otherwise append to its command
    for key in ("VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS"):
        env.pop(key, None)
    install = subprocess.run(["make", "install"], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    check = subprocess.run([py, "-c", "import deepspeed, hydra, omegaconf, wandb, datasets, transformers, rich, "
                            "megatron_lite.training; print(megatron_lite.training.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip().splitlines()[-1].startswith(str(clone)), check.stdout  # the clone's code, installed editable
    gpu = subprocess.run(["make", "bench-gpu"], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert gpu.returncode == 0 and "no CUDA device" in gpu.stdout, gpu.stdout + gpu.stderr[-2000:]
