"""requirements.lock: every package `make install` installs, at one version each, written by pip's own resolver.

    python tools/lock.py write [--torch 2.13.0]     # make lock: resolve today's newest releases, rewrite the lock
    python tools/lock.py torch                      # the torch requirement the lock was resolved with
    python tools/lock.py constraints OUT            # make install: the lock as pip constraints for this machine
    python tools/lock.py check OUT                  # make install, last: what is installed is what OUT pins

`write` asks pip to resolve megatron_lite[dev] (and setuptools and packaging, which the install itself uses) as a
fresh environment would, with torch held at one version (the CPU build's, 2.13.0: torch follows its own rule, see
the Makefile), and writes every package of pip's resolver report (`pip install --dry-run --report`) as name==version.
Nothing in the lock is written by hand; a refresh is a commit like any other, and lands only if the suite passes.

`constraints` keeps the machine's own torch: a torch that is already installed (a cluster's CUDA build) is not
replaced, and the lock's pins that this torch's own requirements exclude (a CUDA build's exact triton, say) give
way to it, each said in one line. Everything else is pinned as locked. `check` then compares what is installed
with those pins, so `make install` ends with exactly the lock's versions or fails naming the package.
`write` and `torch` need only the standard library; `constraints` and `check` need `packaging` (the Makefile
installs it first, at its locked version).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "requirements.lock")
# Asked for beside megatron_lite[dev]: the install builds megatron_lite and DeepSpeed's source distribution without
# build isolation (so the build tools are locked too), and tools/lock.py reads requirements with packaging.
INSTALL_TOOLS = ("setuptools", "packaging")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read(path: str | None = None) -> dict[str, str]:
    """{canonical name: version} of a lock or constraints file (requirements.lock by default; comments and blank
    lines skipped)."""
    path, pins = path or LOCK, {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = PIN.match(line)
            if match is None:
                raise SystemExit(f"lock: {path}:{number}: {line!r} is not name==version; rewrite it with `make lock`")
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def resolve(torch_version: str) -> list[tuple[str, str]]:
    """(name, version) of every package pip would install into an empty environment for megatron_lite[dev], with
    torch held at torch_version; local version labels (+cpu) dropped, megatron_lite itself left out."""
    with tempfile.TemporaryDirectory() as tmp:
        held, report = os.path.join(tmp, "held.txt"), os.path.join(tmp, "report.json")
        with open(held, "w") as f:
            f.write(f"torch=={torch_version}\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            report,
            "-c",
            held,
            "-e",
            f"{ROOT}[dev]",
            *INSTALL_TOOLS,
        ]
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"lock: pip could not resolve megatron_lite[dev]:\n{got.stderr.strip()[-3000:]}")
        with open(report) as f:
            installs = json.load(f)["install"]
    return sorted(
        (
            (item["metadata"]["name"], item["metadata"]["version"].split("+")[0])
            for item in installs
            if not item.get("is_direct")
        ),
        key=lambda nv: canonical(nv[0]),
    )


def write(torch_version: str) -> None:
    pins = resolve(torch_version)
    pip_version = subprocess.run(
        [sys.executable, "-m", "pip", "--version"], capture_output=True, text=True
    ).stdout.split()[1]
    header = [
        "# Every package `make install` installs, at the version it installs: written by `make lock` (tools/lock.py)",
        "# from pip's resolver report, never by hand. megatron_lite[dev] + setuptools and packaging, resolved on",
        f"# {datetime.date.today()} by pip {pip_version} for Python {platform.python_version()} on "
        f"{platform.system()} {platform.machine()}, with torch held at {torch_version}.",
        "# torch: installed at this version only where none imports; a machine's own torch is kept, and the pins it",
        "# requires otherwise (a CUDA build's triton) follow it (README, Installing).",
    ]
    with open(LOCK + ".tmp", "w") as f:
        f.write("\n".join(header + [f"{name}=={version}" for name, version in pins]) + "\n")
    os.replace(LOCK + ".tmp", LOCK)
    print(f"lock: {len(pins)} packages in {os.path.relpath(LOCK)} (torch {torch_version})")


def requirements(name: str, extras: tuple[str, ...] = ()) -> list:
    """The requirements of the installed distribution `name` that apply here (markers evaluated, with `extras`),
    as packaging Requirements."""
    from packaging.requirements import Requirement

    wanted = [Requirement(line) for line in metadata.requires(name) or []]
    return [
        req for req in wanted if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras))
    ]


def closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Canonical names of the installed distributions `name` needs here, transitively (its own `extras`, none of
    theirs), itself included."""
    seen, todo = set(), [(name, extras)]
    while todo:
        dist, wanted = todo.pop()
        if canonical(dist) in seen:
            continue
        seen.add(canonical(dist))
        todo += [(req.name, ()) for req in requirements(dist, wanted)]
    return seen


def constraints(out: str) -> None:
    """Write the lock's pins for this machine to `out`: the installed torch kept, with what it requires."""
    from packaging.version import Version

    pins = read()
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise SystemExit(
            "lock: no torch is installed; the Makefile installs the lock's torch first (`make install`)"
        ) from None
    pins.pop("torch", None)
    for req in requirements("torch"):
        name = canonical(req.name)
        if name in pins and not req.specifier.contains(Version(pins[name]), prereleases=True):
            print(f"lock: {name}=={pins.pop(name)} is not pinned: this machine's torch {have} requires {req}")
    with open(out, "w") as f:
        f.write(f"# requirements.lock for this machine's torch {have} (tools/lock.py constraints)\n")
        f.write("".join(f"{name}=={version}\n" for name, version in pins.items()))


def check(path: str) -> int:
    """0 if every package `path` pins is installed at that version; else say which are not, and return 1."""
    from packaging.version import Version

    wrong, missing = [], []
    for name, version in read(path).items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if Version(have) != Version(version):
            wrong.append(f"{name} {have} (locked: {version})")
    if missing:
        print(
            f"lock: not installed, though locked (not needed on Python {platform.python_version()} here?): "
            f"{', '.join(missing)}"
        )
    if wrong:
        print(
            f"lock: installed at another version than the lock's: {'; '.join(wrong)}. Reinstall with "
            "`rm -r .venv && make install`, or install without the lock (README, Installing)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="resolve today's newest releases and rewrite requirements.lock")
    w.add_argument("--torch", default=None, help="the torch version to resolve with (default: the lock's)")
    sub.add_parser("torch", help="print the lock's torch requirement (torch==VERSION)")
    c = sub.add_parser("constraints", help="write the lock's pins for this machine's torch")
    c.add_argument("out")
    k = sub.add_parser("check", help="installed versions against a constraints file")
    k.add_argument("path")
    args = ap.parse_args(argv)
    if args.command == "write":
        if args.torch is None and not os.path.exists(LOCK):
            raise SystemExit("lock: no requirements.lock yet to take torch's version from: pass --torch VERSION")
        write(args.torch or read()["torch"])
    elif args.command == "torch":
        print(f"torch=={read()['torch']}")
    elif args.command == "constraints":
        constraints(args.out)
    else:
        return check(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
