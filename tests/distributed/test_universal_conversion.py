"""The universal form a layout change converts a checkpoint into (checkpoint/universal.convert_to_universal) is
checked before it is used again, made by concurrent jobs without a race, and put elsewhere for a checkpoint
that cannot be written. Without these: a flipped bit in a cached conversion loads silently (loss inf), a
truncated one crashes every restart, three jobs converting one checkpoint at once crash two of them in
DeepSpeed's merge, and a conversion killed part-way leaves its directories for good."""

import multiprocessing
import os
import socket
import subprocess

import torch

from megatron_lite.checkpoint import universal
from megatron_lite.checkpoint.store import step_name
from tests.distributed.common import overrides
from tests.distributed.launcher import run_configs


def _tensors(target: str) -> dict:
    zero = os.path.join(target, "zero")
    return {
        name: torch.load(os.path.join(zero, name, "fp32.pt"), weights_only=False)["param"]
        for name in sorted(os.listdir(zero))
        if os.path.isdir(os.path.join(zero, name))
    }


def _convert(path: str, queue) -> None:
    try:
        queue.put(universal.convert_to_universal(path))
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put(f"{type(err).__name__}: {err}")


def test_a_conversion_is_checked_before_reuse_and_made_once_by_concurrent_jobs(tmp_path, capsys, monkeypatch):
    run_configs(2, [overrides(tmp_path, "dp2", "train.steps=2", "checkpoint.interval=2", "zero.stage=1")], tmp_path)
    path = os.path.join(tmp_path, "dp2", "checkpoints", step_name(2))

    # three processes convert at once: each writes its own temporary directory; all return the one result
    queue = multiprocessing.get_context("spawn").Queue()
    jobs = [multiprocessing.get_context("spawn").Process(target=_convert, args=(path, queue)) for _ in range(3)]
    for job in jobs:
        job.start()
    results = [queue.get(timeout=300) for _ in jobs]
    for job in jobs:
        job.join()
    target = os.path.join(path, "universal")
    assert results == [target] * 3, results
    assert sorted(n for n in os.listdir(path) if n.startswith("universal")) == ["universal"]  # no leftovers
    good = _tensors(target)

    # what conversions killed on this host left is removed at the next conversion (an NVMe checkpoint's holds
    # copies of its optimizer files); a live one's, and another host's, are not
    dead = subprocess.Popen(["true"])
    dead.wait()
    host, left = socket.gethostname(), os.path.join(os.path.dirname(path), f".{step_name(2)}_universal.tmp.")
    leftovers = {
        f"{left}{host}.{dead.pid}.0a0b": False,
        f"{left}{host}.{dead.pid}.0a0b.input": False,
        f"{left}{host}.{os.getpid()}.0c0d": True,
        f"{left}elsewhere.{dead.pid}.0e0f": True,
    }
    for leftover in leftovers:
        os.makedirs(os.path.join(leftover, "zero"))

    # a flipped byte in a cached file: converted again (with a warning), never loaded as it is
    victim = os.path.join(target, "zero", "wte.weight", "fp32.pt")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    assert universal.convert_to_universal(path) == target
    said = capsys.readouterr().out
    assert "fails its CRC-32 check" in said and said.count("left by a conversion that was killed") == 2
    assert {leftover: os.path.isdir(leftover) for leftover in leftovers} == leftovers
    assert all(torch.equal(good[name], value) for name, value in _tensors(target).items())

    # a step directory the job cannot write: the conversion goes under the job's own directory instead
    monkeypatch.setattr(universal.os, "access", lambda p, mode: os.path.realpath(p) != os.path.realpath(path))
    elsewhere = universal.universal_dir(path, str(tmp_path / "mine"))
    assert os.path.dirname(elsewhere) == str(tmp_path / "mine") and os.path.basename(elsewhere).startswith(
        ".universal_of_step_0000002_"
    )
    assert universal.convert_to_universal(path, elsewhere) == elsewhere
    assert all(torch.equal(good[name], value) for name, value in _tensors(elsewhere).items())
