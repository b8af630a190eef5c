"""Build a wheelhouse: every wheel megatron_lite needs beyond torch, for an offline machine.

GPU nodes are often offline. This collects, on a machine with the package index, the versions requirements.lock
pins (what `make install` installs everywhere), for a target Python version and platform, into one folder:

    python tools/wheelhouse.py --python-version 3.12 --out wheelhouse          # or: make wheelhouse PYVER=3.12

On the offline machine, `make install` finds wheelhouse/ and installs from it with `--no-index`, at the lock's pins.
The lock was resolved for the Python that wrote it; a package that another Python needs beyond it (a backport, say)
is not in the wheelhouse, and the offline install names it.

torch, triton and NVIDIA's CUDA libraries are left out: a GPU machine brings its own CUDA build of torch and
the matching triton, and the Makefile keeps an existing torch. A package published only as a source
distribution (DeepSpeed, antlr4-python3-runtime) is built here into a pure-Python wheel: DeepSpeed with
DS_BUILD_OPS=0, so its C++/CUDA ops are compiled just in time on the node where they run, as DeepSpeed does
by default. A binary package is downloaded for the target platform (manylinux x86-64 by default).

`--skip NAME,...` leaves out packages the target machine already has (to keep a carried folder small).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import lock  # noqa: E402

# Never in the wheelhouse: the machine's own CUDA build of torch brings these.
LEFT_OUT = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pip)$")
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], env=env, capture_output=True, text=True)


def source_only(specs: list[str], target: list[str], out: str) -> list[str]:
    """Download the target's binary wheel of every spec into out; return the specs that have none.

    One pip process for all of them (one per package took over a minute for 80), dropping each spec pip says it
    cannot find and trying again; a failure pip does not pin on one spec is retried one spec at a time."""

    def download(*some: str) -> subprocess.CompletedProcess:
        return pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", out, *some)

    todo, missing = list(specs), []
    while todo:
        got = download(*todo)
        if got.returncode == 0:
            return missing
        named = re.search(r"No matching distribution found for (\S+)", got.stderr)
        if named is None or named.group(1) not in todo:
            break
        todo.remove(named.group(1))
        missing.append(named.group(1))
    for spec in todo:
        if download(spec).returncode != 0:
            missing.append(spec)
    return missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="wheelhouse")
    ap.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="target interpreter, e.g. 3.12 (default: this one)",
    )
    ap.add_argument(
        "--platform",
        action="append",
        default=None,
        help=f"target platform tag(s) for binary wheels (default: {', '.join(PLATFORMS)})",
    )
    ap.add_argument("--skip", default="", help="comma-separated packages the target already has")
    args = ap.parse_args(argv)

    skip = {lock.canonical(s) for s in args.skip.split(",") if s}
    pins = {k: v for k, v in lock.read().items() if k not in skip and not LEFT_OUT.match(k)}
    os.makedirs(args.out, exist_ok=True)
    target = ["--python-version", args.python_version, "--implementation", "cp"]
    for plat in args.platform or PLATFORMS:
        target += ["--platform", plat]
    built = []
    for spec in source_only([f"{name}=={version}" for name, version in pins.items()], target, args.out):
        # No wheel for the target: a source-only package. Build it here; it must come out pure Python.
        env = dict(os.environ, DS_BUILD_OPS="0")
        got = pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", args.out, spec, env=env)
        if got.returncode != 0:
            print(
                f"wheelhouse: {spec}: no wheel for Python {args.python_version} on {args.platform or 'manylinux'} "
                f"and building one failed:\n{got.stderr.strip()[-2000:]}",
                file=sys.stderr,
            )
            return 1
        built.append(spec)
    wheels = [f for f in os.listdir(args.out) if f.endswith(".whl")]
    impure = [
        w
        for w in wheels
        if any(w.startswith(lock.canonical(s.split("==")[0]).replace("-", "_")) for s in built)
        and not w.endswith("-none-any.whl")
    ]
    if impure:
        print(f"wheelhouse: built wheels are not pure Python (they would not run elsewhere): {impure}", file=sys.stderr)
        return 1
    size = sum(os.path.getsize(os.path.join(args.out, w)) for w in wheels) / 2**20
    print(
        f"wheelhouse: {len(pins)} packages for Python {args.python_version} in {args.out}/ "
        f"({len(wheels)} wheels, {size:.0f} MiB; built from source: {', '.join(built) or 'none'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
