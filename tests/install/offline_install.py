"""The steps of the offline install, for tests/install/test_wheelhouse.py, which checks what they recorded.

    python tests/install/offline_install.py [--idle] OUT

`make wheelhouse`'s tool on this machine (which reaches the package index), then a clean clone whose `make install`
cannot reach the network at all, as on an offline GPU node; then the clone's environment imports what the product
needs and its `make bench-gpu` says there is no CUDA device. Torch is the one package the node brings itself (here:
this environment's torch and its own requirements, linked into the clone's fresh virtual environment).

The steps take about two minutes, almost all of it pip on one core, so the test session runs them in the background
from its start on the cores' idle time (--idle: Linux SCHED_IDLE, as tools/build_ops.py; tests/conftest.py) and
the test, last in the session, reads OUT/steps.json: per step, its command's exit code and the end of its output.
A failed step ends the list.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import venv
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.lock import closure  # noqa: E402

UNREACHABLE = "http://127.0.0.1:9"  # nothing listens there: any download fails at once
# what the clone's environment must import: the product and what it runs on
IMPORTS = "import deepspeed, hydra, omegaconf, wandb, datasets, transformers, rich, megatron_lite.training"


def _link_torch(site: str) -> None:
    """Symlink torch, triton (a CUDA torch's requirement; the CPU build here lacks it), their requirements and
    dist-info into `site`: a GPU node's preinstalled torch stack."""
    os.makedirs(site)
    for name in closure("torch") | closure("triton"):
        dist = metadata.distribution(name)
        tops = (dist.read_text("top_level.txt") or "").split() or [re.sub(r"[-.]", "_", name).lower()]
        paths = {str(f).split("/")[0] for f in dist.files or []}
        for entry in paths & ({f for f in paths if f.endswith(".dist-info")} | set(tops) | {f"{t}.py" for t in tops}):
            src = dist.locate_file(entry)
            if os.path.exists(src) and not os.path.exists(os.path.join(site, entry)):
                os.symlink(src, os.path.join(site, entry))


def offline_env() -> dict:
    """This environment with pip's index off and every proxy unreachable."""
    env = dict(
        os.environ,
        PIP_NO_INDEX="1",
        http_proxy=UNREACHABLE,
        https_proxy=UNREACHABLE,
        HTTP_PROXY=UNREACHABLE,
        HTTPS_PROXY=UNREACHABLE,
        PIP_CONFIG_FILE=os.devnull,
    )
    # `make test ARGS=...` passes its ARGS down: in MAKEFLAGS, and as an environment variable of its own (make
    # exports command-line variables), which `make bench-gpu` would otherwise append to its command
    for key in ("VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS"):
        env.pop(key, None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="an empty or new folder: the wheelhouse, the clone and steps.json go there")
    parser.add_argument("--idle", action="store_true", help="run on idle CPU time only (Linux SCHED_IDLE)")
    args = parser.parse_args(argv)
    if args.idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.makedirs(args.out, exist_ok=True)
    wheelhouse, clone = os.path.join(args.out, "wheelhouse"), os.path.join(args.out, "clone")
    steps: list[dict] = []

    def step(name: str, cmd: list[str], **kw) -> bool:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        steps.append(
            {
                "step": name,
                "cmd": cmd,
                "returncode": proc.returncode,
                "stdout": proc.stdout[-3000:],
                "stderr": proc.stderr[-3000:],
            }
        )
        with open(os.path.join(args.out, "steps.json.tmp"), "w") as f:
            json.dump({"wheelhouse": wheelhouse, "clone": clone, "steps": steps}, f, indent=1)
        os.replace(os.path.join(args.out, "steps.json.tmp"), os.path.join(args.out, "steps.json"))
        return proc.returncode == 0

    if not step("wheelhouse", [sys.executable, "tools/wheelhouse.py", "--out", wheelhouse], cwd=ROOT):
        return 0
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    os.symlink(wheelhouse, os.path.join(clone, "wheelhouse"))
    venv.create(os.path.join(clone, ".venv"), with_pip=True)  # no system site-packages: only torch is there beforehand
    py = os.path.join(clone, ".venv", "bin", "python")
    site = subprocess.check_output(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    _link_torch(os.path.join(args.out, "node_torch"))
    with open(os.path.join(site, "node_torch.pth"), "w") as f:
        f.write(os.path.join(args.out, "node_torch") + "\n")
    env = offline_env()
    if not step("make install", ["make", "install"], cwd=clone, env=env):
        return 0
    if not step("import", [py, "-c", f"{IMPORTS}; print(megatron_lite.training.__file__)"], cwd=args.out, env=env):
        return 0
    step("make bench-gpu", ["make", "bench-gpu"], cwd=clone, env=env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
