"""checkpoint_writer.AsyncWriter's rules without a process group: rank 0 commits only once every rank's files
are durable and listed, a missing rank means no commit (after the timeout), a failed background write is raised
in the loop, one save is in flight at a time, and staging copies tensors (later in-place updates do not leak in)."""

import json
import os
import time

import pytest
import torch

from megatron_lite.checkpoint import writer as checkpoint_writer
from megatron_lite.checkpoint.store import shard_files
from megatron_lite.checkpoint.writer import AsyncWriter, to_host
from megatron_lite.engine.ds_checkpoint import staging_engine


def _files(path, rank):
    return [(os.path.join(path, f"part_rank{rank}.pt"), {"w": torch.full((3,), float(rank))})]


def test_rank0_commits_after_every_share_with_the_merged_manifest(tmp_path):
    path, commits, logs = str(tmp_path / "step_0000002"), [], []
    writers = [AsyncWriter(r, 2, commit_timeout_s=30, log=logs.append) for r in range(2)]
    writers[0].submit(path, 2, _files(path, 0), commit=commits.append)
    time.sleep(0.5)
    assert writers[0].busy() and commits == []  # rank 1 has not written: rank 0 waits, commits nothing
    writers[1].submit(path, 2, _files(path, 1), commit=None)
    assert writers[1].wait() is not None
    assert writers[0].wait() is not None
    (manifest,) = commits
    assert sorted(manifest) == ["part_rank0.pt", "part_rank1.pt"]
    assert manifest["part_rank1.pt"][0] == os.path.getsize(os.path.join(path, "part_rank1.pt"))
    assert torch.load(os.path.join(path, "part_rank1.pt"))["w"].tolist() == [1.0, 1.0, 1.0]
    assert all(not name.startswith(".share") for name in shard_files(path))  # shares are not checkpoint files
    checkpoint_writer.remove_shares(path)
    assert sorted(os.listdir(path)) == ["part_rank0.pt", "part_rank1.pt"]


def test_a_missing_rank_means_no_commit_and_the_error_reaches_the_loop(tmp_path):
    path, commits = str(tmp_path / "step_0000004"), []
    writer = AsyncWriter(0, 2, commit_timeout_s=0.3, log=print)
    writer.submit(path, 4, _files(path, 0), commit=commits.append)
    with pytest.raises(RuntimeError, match=r"step 4 failed.*ranks \[1\] wrote no manifest share"):
        writer.wait()
    assert commits == []


def test_a_failed_write_is_raised_and_the_next_save_may_start(tmp_path, monkeypatch):
    def disk_full(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_writer, "write_file", disk_full)
    path = str(tmp_path / "step_0000006")
    writer = AsyncWriter(1, 2, commit_timeout_s=30, log=print)
    writer.submit(path, 6, _files(path, 1), commit=None)
    with pytest.raises(RuntimeError, match="No space left"):
        writer.wait()
    assert not os.path.exists(os.path.join(path, ".share_rank00001.json"))  # rank 0 will not commit step 6
    monkeypatch.undo()
    writer.submit(path, 8, _files(path, 1), commit=None)
    assert writer.wait() is not None


def test_one_save_in_flight_and_the_wait_says_so(tmp_path, monkeypatch):
    import threading

    gate = threading.Event()
    real = checkpoint_writer.write_file
    monkeypatch.setattr(checkpoint_writer, "write_file", lambda obj, p: (gate.wait(10), real(obj, p)))
    logs, path = [], str(tmp_path / "step_0000010")
    writer = AsyncWriter(1, 2, commit_timeout_s=30, log=logs.append)
    writer.submit(path, 10, _files(path, 1), commit=None)
    with pytest.raises(AssertionError, match="one save in flight"):
        writer.submit(path, 12, _files(path, 1), commit=None)
    threading.Timer(0.2, gate.set).start()
    writer.wait(reason="checkpoint of step 12")
    assert logs == ["checkpoint of step 12: waiting for the checkpoint of step 10, still being written"]


def test_staging_copies_tensors_and_keeps_aliasing():
    w = torch.arange(6.0)
    state = {"a": w, "b": [w, w[:3]], "n": 3, "s": "x"}
    staged = to_host(state, pin=False)
    w.add_(100)  # the training loop updates the parameters after staging
    assert staged["a"].tolist() == list(range(6)) and staged["b"][0] is staged["a"]
    assert staged["b"][1].tolist() == [0.0, 1.0, 2.0] and staged["n"] == 3 and staged["s"] == "x"
    engine = staging_engine(lambda state: to_host(state, pin=False))
    engine.save(state, "/nowhere/model.pt")
    assert engine.staged[0][0] == "/nowhere/model.pt" and not engine.preserves_storage_sharing()
    assert json.dumps(engine.staged[0][1]["n"]) == "3"


def test_staging_buffers_are_reused_after_the_write(tmp_path):
    path = str(tmp_path / "step_0000002")
    writer = AsyncWriter(1, 2, commit_timeout_s=30, log=print)
    state = {"w": torch.randn(4, 5), "m": torch.randn(7)}
    first = staging_engine(lambda state: to_host(state, pin=False, pool=writer.pool))
    first.save(state, os.path.join(path, "a.pt"))
    buffers = {id(t) for t in first.staged[0][1].values()}
    writer.submit(path, 2, first.staged, commit=None)
    writer.wait()
    state["w"].add_(1.0)
    second = staging_engine(lambda state: to_host(state, pin=False, pool=writer.pool))
    second.save(state, os.path.join(path, "a.pt"))
    assert {id(t) for t in second.staged[0][1].values()} == buffers  # the same host pages, no new allocation
    assert torch.equal(second.staged[0][1]["w"], state["w"])  # with this save's values
