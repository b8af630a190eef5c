"""The on-disk protocol without DeepSpeed (checkpoint/store.py): manifests catch truncated and corrupted files,
resume=auto passes over unsound checkpoints and a dangling `latest`, nothing newer than the committed step is
pruned, a committed directory is renamed aside rather than deleted, and the config-time check refuses in one
line a resume that would train over newer checkpoints or find nothing sound."""

import json
import os

import pytest

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.resume import first_sound
from megatron_lite.cli import load
from megatron_lite.errors import ConfigError


def commit(root, step: int, files: dict[str, bytes] | None = None, move_latest: bool = True) -> str:
    """A committed step directory as checkpoint.save leaves it: shards, meta.json with the manifest, latest."""
    path = os.path.join(root, store.step_name(step))
    os.makedirs(path)
    for name, data in (files or {"mp_rank_00_model_states.pt": b"x" * (100 + step), "rng_rank00000.pt": b"r"}).items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    cfg = load(["train.precision=fp32"], world_size=1)
    meta = {
        "kind": "deepspeed",
        "step": step,
        "manifest": store.manifest_share(path, 0, 1),
        "config": {"model": vars(cfg.model)},
        "layout": {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "vpp": 1, "zero_stage": 0, "precision": "fp32"},
    }
    store.atomic_write(os.path.join(path, store.META), store.meta_text(meta))
    if move_latest:
        store.atomic_write(os.path.join(root, store.LATEST), store.step_name(step))
    return path


def shard(path: str) -> str:
    return os.path.join(path, "mp_rank_00_model_states.pt")


def test_manifest_catches_truncation_and_corruption(tmp_path):
    path = commit(tmp_path, 2)
    assert store.verify(path, checksums=True) is None
    with open(shard(path), "r+b") as f:
        f.seek(10)
        f.write(b"y")  # same size, other bytes
    assert store.verify(path) is None  # sizes alone cannot see it
    assert "fails its CRC-32 check" in store.verify(path, checksums=True)
    os.truncate(shard(path), 50)
    assert store.verify(path) == f"{shard(path)} has 50 bytes, the manifest says 102 (truncated or rewritten)"
    os.remove(shard(path))
    assert store.verify(path) == f"{shard(path)} is missing"


def test_manifest_shares_cover_every_file_once(tmp_path):
    path = commit(tmp_path, 2, {f"f{i}": bytes(i) for i in range(7)})
    shares = [store.manifest_share(path, r, 3) for r in range(3)]
    assert sorted(k for s in shares for k in s) == [f"f{i}" for i in range(7)]
    assert {k: v for s in shares for k, v in s.items()} == store.read_meta(path)["manifest"]


def test_auto_resume_passes_over_a_truncated_newest_and_a_dangling_latest(tmp_path):
    for step in (2, 4, 6):
        commit(tmp_path, step)
    assert store.resume_candidates(tmp_path) == ([os.path.join(tmp_path, store.step_name(s)) for s in (6, 4, 2)], [])
    os.truncate(shard(os.path.join(tmp_path, store.step_name(6))), 3)
    assert first_sound(str(tmp_path)) == os.path.join(tmp_path, store.step_name(4))
    store.atomic_write(os.path.join(tmp_path, store.LATEST), store.step_name(10))  # names a directory that is gone
    candidates, notes = store.resume_candidates(tmp_path)
    assert notes == [f"{tmp_path}/latest names step_0000010, which does not exist"]
    assert candidates[0] == os.path.join(tmp_path, store.step_name(6))


def test_latest_is_a_pointer_every_committed_checkpoint_is_a_candidate(tmp_path):
    """meta.json is written once every file is durable and checksummed, so a checkpoint is committed even where
    `latest` was not moved to it (a crash in between) or names an older or a missing one, or cannot be read:
    auto tries the newest first and says what `latest` holds (trusting `latest` instead, one naming a missing step
    below the real ones would refuse to resume at all, and one naming an older step would roll back to it)."""
    for step in (4, 8):
        commit(tmp_path, step)
    commit(tmp_path, 12, move_latest=False)
    newest_first = [os.path.join(tmp_path, store.step_name(s)) for s in (12, 8, 4)]
    latest = os.path.join(tmp_path, store.LATEST)
    assert store.resume_candidates(tmp_path) == (
        newest_first,
        [f"{latest} names step_0000008, older than the committed step_0000012"],
    )
    store.atomic_write(latest, store.step_name(2))
    assert store.resume_candidates(tmp_path)[0] == newest_first
    for garbage in (b"\xff\xfe\x00garbage", b"", b"step_12"):
        with open(latest, "wb") as f:
            f.write(garbage)
        candidates, notes = store.resume_candidates(tmp_path)
        assert candidates == newest_first and len(notes) == 1, (garbage, notes)
    os.remove(latest)
    os.mkdir(latest)
    assert store.resume_candidates(tmp_path)[0] == newest_first and store.latest_name(tmp_path) is None
    os.rmdir(latest)
    os.symlink(latest, latest)  # a loop
    assert store.resume_candidates(tmp_path)[1][0].startswith(f"{latest} cannot be read (OSError")


def test_prune_keeps_newer_checkpoints_and_renames_committed_ones_aside(tmp_path):
    for step in (2, 4, 6, 8):
        commit(tmp_path, step)
    os.makedirs(os.path.join(tmp_path, store.step_name(3)))  # an uncommitted leftover
    deleted = store.prune(tmp_path, keep=1, committed=4)  # a resumed run just committed step 4
    assert sorted(os.path.basename(p) for p in deleted) == ["step_0000002", "step_0000003"]
    assert [os.path.basename(p) for p in store.complete_steps(tmp_path)] == [
        "step_0000004",
        "step_0000006",
        "step_0000008",
    ]
    aside = store.clear_for_write(os.path.join(tmp_path, store.step_name(6)))
    assert aside.startswith(os.path.join(tmp_path, "step_0000006.corrupt.")) and store.is_complete(aside)
    os.makedirs(os.path.join(tmp_path, store.step_name(7)))
    assert store.clear_for_write(os.path.join(tmp_path, store.step_name(7))) is None  # leftovers just go
    assert not os.path.exists(os.path.join(tmp_path, store.step_name(7)))


def test_config_time_refusals(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in (2, 4):
        commit(root, step)
    base = [f"checkpoint.dir={root}", "train.precision=fp32"]
    load([*base, "checkpoint.resume=auto"], world_size=1)
    with pytest.raises(ConfigError, match=r"would train over newer checkpoints .*\(step_0000004\); resume the newest"):
        load([*base, f"checkpoint.resume={root}/{store.step_name(2)}"], world_size=1)
    for step in (2, 4):
        os.truncate(shard(os.path.join(root, store.step_name(step))), 1)
    with pytest.raises(ConfigError) as err:
        load([*base, "checkpoint.resume=auto"], world_size=1)
    message = str(err.value)
    assert "\n" not in message and "found no sound checkpoint" in message and "checkpoint.resume=never" in message
    assert "step_0000004: " in message and "has 1 bytes" in message
    load([*base, "checkpoint.resume=never"], world_size=1)


def test_only_uncommitted_step_directories_start_fresh(tmp_path, capsys):
    """An interrupted first save leaves a step directory without meta.json and no `latest`: nothing was ever
    committed, so resume=auto starts from step 0 (at config time and in the ranks), saying so; the run's own save
    of that step replaces the leftover."""
    from types import SimpleNamespace

    from megatron_lite.checkpoint.resume import choose_resume

    root = str(tmp_path / "ckpt")
    leftover = os.path.join(root, store.step_name(2))
    os.makedirs(leftover)
    with open(shard(leftover), "wb") as f:
        f.write(b"half")
    load([f"checkpoint.dir={root}", "checkpoint.resume=auto", "train.precision=fp32"], world_size=1)
    assert choose_resume("auto", root, SimpleNamespace(is_rank0=True, rank=0, world_size=1)) is None
    assert "holds only step directories that never committed (step_0000002" in capsys.readouterr().out
    assert store.clear_for_write(leftover) is None and not os.path.exists(leftover)


def test_steps_past_ten_million_resume_and_prune_in_step_order(tmp_path):
    """step_%07d grows an eighth digit at 10,000,000: such directories are candidates, ordered by step (not by
    name, where step_10000000 sorts before step_9999999), and pruned oldest first."""
    for step in (9_999_998, 9_999_999, 10_000_000):
        commit(tmp_path, step)
    names = [os.path.basename(p) for p in store.complete_steps(tmp_path)]
    assert names == ["step_9999998", "step_9999999", "step_10000000"]
    assert first_sound(str(tmp_path)) == os.path.join(tmp_path, "step_10000000")
    assert store.resume_candidates(tmp_path)[0][:2] == [
        os.path.join(tmp_path, n) for n in ("step_10000000", "step_9999999")
    ]
    deleted = store.prune(tmp_path, keep=2, committed=10_000_000)
    assert [os.path.basename(p) for p in deleted] == ["step_9999998"]


def test_a_changed_field_of_meta_json_fails_its_crc(tmp_path):
    """meta.json carries a CRC-32 of its fields (a changed consumed_samples or step would otherwise resume
    silently, the losses then off by up to 9e-2); auto passes such a checkpoint over. One written before the CRC
    existed has none and is taken as it is."""
    commit(tmp_path, 4)
    path = commit(tmp_path, 8)
    assert store.meta_problem(path) is None and first_sound(str(tmp_path)) == path
    text = open(os.path.join(path, store.META)).read()
    store.atomic_write(os.path.join(path, store.META), text.replace('"step": 8', '"step": 9'))
    assert store.verify(path) == f"{path}/meta.json fails its CRC-32 check (corrupted)"
    assert first_sound(str(tmp_path)) == os.path.join(tmp_path, store.step_name(4))
    meta = json.loads(text)
    del meta[store.META_CRC]
    store.atomic_write(os.path.join(path, store.META), json.dumps(meta))
    assert store.verify(path) is None


def test_a_step_set_aside_twice_in_one_second_keeps_both(tmp_path):
    first = store.clear_for_write(commit(tmp_path, 4))
    second = store.clear_for_write(commit(tmp_path, 4))
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
