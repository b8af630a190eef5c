"""Bad configuration fails before any process group exists, with one line: key, value, why, fix."""

import json
import os
import subprocess
import sys

import pytest

from megatron_lite.cli import compose_config, load
from megatron_lite.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    """run.dir and checkpoint.dir are relative to the working directory: keep real runs out of sight."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def data_dir(tmp_path):
    return prepared(tmp_path)


def prepared(
    path,
    tokenizer: str = "assets/tokenizers/shakespeare-8k",
    vocab: int = 8192,
    train: int = 100_000,
    val: int = 10_000,
    held: dict | None = None,
    eos: int | None = 0,
) -> str:
    """A prepared data directory as validation sees it: meta.json, and token files of the sizes it records
    (sparse: validation reads their sizes only); held: split -> tokens its file holds instead (None: no file);
    eos None: no eos_id in meta.json (data prepared before one was recorded). No document index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(
            {
                "dtype": "uint16",
                "vocab_size": vocab,
                **({} if eos is None else {"eos_id": eos}),
                "tokenizer": tokenizer,
                "train_tokens": train,
                "val_tokens": val,
            },
            f,
        )
    for split, tokens in (("train", train), ("val", val)):
        tokens = (held or {}).get(split, max(tokens, 1))
        if tokens is not None:
            with open(os.path.join(path, f"{split}.bin"), "wb") as f:
                f.truncate(2 * tokens)
    return str(path)


# (overrides, world size, text the one-line message must contain)
BAD = [
    (["zero.stage=4"], 1, "zero.stage=4"),
    (["train.profile_steps=[3,2]"], 1, "train.profile_steps=[3, 2] must be [first, last] steps with 1 <= first"),
    (["train.profile_steps=[0,2]"], 1, "train.profile_steps=[0, 2] must be"),
    (["train.profile_steps=[4]"], 1, "train.profile_steps=[4] must be"),
    (
        ["train.profile_steps=[2,3]", "train.profile_ranks=[0,2]"],
        2,
        "train.profile_ranks=[0, 2] must name ranks of the 2 in this run; use e.g. [0] or [0,1]",
    ),
    (["train.profile_ranks=[]"], 1, "train.profile_ranks=[] must name ranks"),
    (["zero.stage=2", "zero.offload_param=cpu"], 1, "zero.offload_param=cpu needs zero.stage=3"),
    (["zero.offload_optimizer=cpu"], 1, "zero.offload_optimizer=cpu needs zero.stage >= 1"),
    (
        ["zero.stage=2", "zero.offload_optimizer=nvme"],
        1,
        "zero.offload_optimizer=nvme needs zero.stage=3 (got 2: "
        "DeepSpeed's ZeRO-1 and -2 offload the optimizer to CPU memory only)",
    ),
    (["zero.stage=3", "zero.offload_param=nvme", "zero.nvme_path="], 1, "zero.nvme_path='' is empty"),
    (
        ["zero.stage=3", "zero.offload_param=nvme", "zero.nvme_path=/proc/version/swap"],
        1,
        "zero.nvme_path=/proc/version/swap cannot be written",
    ),
    (["train.global_batch_size=12", "train.micro_batch_size=8"], 1, "train.global_batch_size=12"),
    (["train.global_batch_size=16", "train.micro_batch_size=8"], 4, "x dp=4"),
    (["parallel.tp=2"], 3, "must divide the world size 3"),
    (["parallel.tp=8"], 8, "parallel.tp=8 must divide model.n_heads=4"),
    (["model=llama-tiny", "parallel.tp=4"], 4, "parallel.tp=4 must divide model.n_kv_heads=2"),
    (["parallel.pp=3"], 3, "parallel.pp=3 makes parallel.pp*parallel.vpp=3*1=3 virtual stages"),
    (["parallel.pp=2", "parallel.vpp=4"], 2, "parallel.vpp=4 makes parallel.pp*parallel.vpp=2*4=8"),
    (["parallel.vpp=2"], 1, "parallel.vpp=2 needs parallel.pp > 1"),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], 2, "parallel.pp_layers=[1,2] sums to 3"),
    (["parallel.pp=2", "parallel.pp_layers=[4]"], 2, "parallel.pp_layers=[4] has 1 entries"),
    (["parallel.pp=4", "parallel.pp_layers=[2,0,0,2]"], 4, "leaves virtual stage 1 without layers"),
    (["parallel.pp=2", "parallel.schedule=zigzag"], 2, "parallel.schedule=zigzag is not a valid choice"),
    (["parallel.pp=2", "zero.stage=3"], 2, "zero.stage=3 does not compose with parallel.pp=2"),
    (
        ["parallel.pp=4", "train.global_batch_size=8", "train.micro_batch_size=4"],
        4,
        "fewer than parallel.pp=4, which the 1f1b schedule needs (every one but gpipe)",
    ),
    (
        ["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=8", "train.micro_batch_size=8"],
        2,
        "fewer than parallel.pp=2, which the interleaved schedule needs",
    ),
    (["parallel.cp=2"], 3, "parallel.cp=2 makes tp*cp*pp=2 (tp=1, cp=2, pp=1), which must divide the world size 3"),
    (["parallel.cp=3"], 3, "parallel.cp=3 needs 2*cp=6 to divide model.seq_len=128"),
    (
        ["parallel.cp=4", "parallel.tp=2", "parallel.sp=true", "model.seq_len=24"],
        8,
        "parallel.cp=4 needs 2*cp*tp=16 (with parallel.sp) to divide model.seq_len=24",
    ),
    (["parallel.cp=2", "parallel.cp_mode=zigzag"], 2, "parallel.cp_mode=zigzag is not a valid choice"),
    (
        ["model=llama-tiny", "parallel.cp=4", "parallel.cp_mode=ulysses"],
        4,
        "parallel.cp=4 with parallel.cp_mode=ulysses must divide the n_kv_heads per TP rank (model.n_kv_heads=2 / "
        "parallel.tp=1 = 2); use parallel.cp in [1, 2], or parallel.cp_mode=ring",
    ),
    (
        ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.tp=4"],
        8,
        "must divide the n_heads per TP rank (model.n_heads=4 / parallel.tp=4 = 1)",
    ),
    (["parallel.cp=2", "train.compile=true"], 2, "train.compile=True does not work with parallel.cp=2"),
    (["model.n_heads=3"], 1, "model.n_heads=3 must divide model.d_model=128"),
    (["model.n_kv_heads=3"], 1, "model.n_kv_heads=3 must divide model.n_heads=4"),
    (["optim.lr=-1"], 1, "optim.lr=-1"),
    (["train.steps=-5"], 1, "train.steps=-5 must be positive"),
    (["train.steps=0"], 1, "train.steps=0 must be positive"),
    (["optim.warmup_steps=-1"], 1, "optim.warmup_steps=-1"),
    (["train.precision=fp16"], 1, "train.precision=fp16 is not a valid choice"),
    (["train.compile=true", "zero.stage=3"], 2, "train.compile=True does not work with zero.stage=3"),
    (["model.dropout=1.5"], 1, "model.dropout=1.5"),
    (["model.norm=batchnorm"], 1, "model.norm=batchnorm"),
    (["checkpoint.resume=/no/such/ckpt"], 1, "checkpoint.resume=/no/such/ckpt"),
    (["model=gpt5"], 1, "model=gpt5 is not a known preset"),
    (["train.foo=1"], 1, "train.foo=1 is not a config key"),
    (["train.steps=abc"], 1, "train.steps=abc"),
    (["train.steps"], 1, "not an override"),
    (["train.recompute=some"], 1, "train.recompute=some is not a valid choice"),
    (["train.recompute=full", "train.recompute_every=0"], 1, "train.recompute_every=0 must be >= 1"),
    (["parallel.cp=3"], 6, "use parallel.cp in [1, 2] or"),  # unchecked: [1, 2, 4, ...], and cp=4 does not divide 6
    (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "model.seq_len=132"], 4, "use parallel.cp in [1] or"),
    (["+train.stpes=3"], 1, "train.stpes=3 is not a config key (given as +train.stpes=3"),
    (["++train.foo=1"], 1, "train.foo=1 is not a config key"),
    (["+model.n_layers=3"], 1, "write it without the +: model.n_layers=3"),
    (["model.vocab_multiple=0"], 1, "model.vocab_multiple=0 must be positive"),  # unchecked: ZeroDivisionError
    (["optim.eps=-1"], 1, "optim.eps=-1.0 must be a positive number"),  # unchecked: torch's ValueError traceback
    (["model.init_std=-1"], 1, "model.init_std=-1.0 must be a positive number"),
    (["model.norm_eps=-1"], 1, "model.norm_eps=-1.0 must be a positive number"),  # unchecked: trained on NaN
    (["model.rope_theta=0"], 1, "model.rope_theta=0.0 must be a positive number"),
    (["zero.hpz=2"], 4, "zero.hpz=2 needs zero.stage=3 (got 0"),
    (
        ["zero.stage=3", "zero.hpz=3"],
        4,
        "zero.hpz=3 must divide the 4 ZeRO ranks (dp=4 x cp=1) into groups; use one of 1, 2, 4",
    ),
    (["zero.stage=3", "zero.hpz=0"], 4, "zero.hpz=0 must be >= 1"),
    (
        ["zero.stage=2", "zero.shard_size=3"],
        4,
        "zero.shard_size=3 must divide dp=4 into groups of replicas; use one of 1, 2, 4",
    ),
    (["zero.shard_size=2"], 4, "zero.shard_size=2 needs zero.stage >= 1"),
    (["zero.stage=1", "zero.shard_size=0"], 4, "zero.shard_size=0 must be >= 1"),
    (["zero.stage=3", "zero.shard_size=2", "zero.hpz=2"], 4, "use one: zero.hpz=1 or zero.shard_size=null"),
    (
        ["zero.stage=2", "zero.shard_size=1", "zero.offload_optimizer=cpu"],
        2,
        "zero.shard_size=1 with zero.offload_optimizer=cpu at zero.stage=2: DeepSpeed's ZeRO-1/2 offload",
    ),
    # Without these checks each is a traceback after the process group starts, or a run that goes wrong.
    (["seed=-1"], 1, "seed=-1 must be in [0, 2**63)"),  # numpy's sampler refused it at step 1
    (["seed=99999999999999999999"], 1, "must be in [0, 2**63)"),  # torch.manual_seed overflowed
    (["optim.weight_decay=nan"], 1, "optim.weight_decay=nan must be a finite number >= 0"),
    (["optim.min_lr=nan"], 1, "optim.min_lr=nan must be in [0, optim.lr="),  # trained on an lr of nan
    (["train.grad_clip=nan"], 1, "train.grad_clip=nan must be a finite number >= 0"),  # clipping silently off
    (["checkpoint.dir=''"], 1, "checkpoint.dir='' is empty"),  # a traceback at the first save
    (["run.dir=''"], 1, "run.dir='' is empty"),
    (["train.fp8=e4m3"], 1, "train.fp8=e4m3 is not a valid choice; use one of none, tensorwise, rowwise"),
    (["train.stpes=3"], 1, "did you mean train.steps=...?"),
    (["nosuch=1"], 1, "the groups are model,"),
    (["model.n_layers=4.5"], 1, "give a value of its type, e.g. model.n_layers="),
]


@pytest.mark.parametrize("overrides,world,expected", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_value_gives_one_line(overrides, world, expected, data_dir):
    with pytest.raises(ConfigError) as err:
        load([f"data.path={data_dir}", *overrides], world_size=world)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message and ";" in message  # one line, with a fix after the reason


def test_triton_on_cpu_needs_the_interpreter(data_dir, monkeypatch):
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("a GPU runs Triton natively")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels.backend=triton needs a GPU.*TRITON_INTERPRET=1"):
        load([f"data.path={data_dir}", "kernels.backend=triton"], world_size=1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load([f"data.path={data_dir}", "kernels.backend=triton"], world_size=1).kernels.backend == "triton"


def test_missing_data_path_names_the_fix():
    with pytest.raises(ConfigError, match=r"data.path=/nope/data has no prepared data.*prepare_data.py"):
        load(["data.path=/nope/data"], world_size=1)


def test_good_config_composes_every_preset(data_dir):
    for preset in ("tiny", "llama-tiny", "gpt2-124m", "gpt2-350m", "gpt-1.3b", "llama-7b"):
        cfg = load([f"model={preset}", f"data.path={data_dir}"], world_size=1)
        assert cfg.model.name == preset
    assert compose_config(["zero.stage=3"]).zero.stage == 3


def _torchrun_summary(error_file, exitcode: int) -> str:
    """What torchrun prints after a rank failed with this error file (its ChildFailedError's message)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("train.py", {0: failure}).format_msg()


def test_train_py_exits_2_with_one_line_and_no_traceback(tmp_path):
    """One line, once; under torchrun it is also the root cause its failure summary gives (cli.tell_torchrun), and
    a crash's traceback is (not: "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, RANK="0", WORLD_SIZE="4", TORCHELASTIC_ERROR_FILE=str(error_file))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "zero.stage=3",
            "zero.offload_param=cpu",
            "train.global_batch_size=6",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("config error: train.global_batch_size=6")
    assert f"traceback : {lines[0]}\n" in _torchrun_summary(error_file, 2)

    crash = tmp_path / "crash.json"
    proc = subprocess.run(
        [sys.executable, "-c", "from megatron_lite.cli import exit_process; exit_process(lambda: 1 / 0)"],
        env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(crash), PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "ZeroDivisionError" in proc.stderr
    summary = _torchrun_summary(crash, 1)
    assert (
        "traceback : Traceback (most recent call last):" in summary and "ZeroDivisionError: division by zero" in summary
    )


def test_check_validates_for_the_world_size_and_starts_nothing(data_dir, tmp_path):
    """`train.py --check`, what slurm/train.sbatch runs once before srun: 0 and the one-line prediction (plan/) for
    a config that fits WORLD_SIZE, 2 with the one-line error otherwise; no run directory, no process group either
    way."""

    def check(*overrides):
        env = dict(os.environ, WORLD_SIZE="2")
        env.pop("RANK", None)  # the batch shell is no rank
        return subprocess.run(
            [sys.executable, os.path.join(ROOT, "train.py"), "--check", f"run.dir={tmp_path}/run", *overrides],
            env=env,
            capture_output=True,
            text=True,
        )

    good, bad = check("parallel.tp=2"), check("parallel.tp=4")
    assert good.returncode == 0 and "error" not in good.stderr, good.stderr
    assert good.stdout.startswith("layout: dp 1, tp 2") and len(good.stdout.strip().splitlines()) == 1, good.stdout
    assert bad.returncode == 2 and bad.stderr.startswith("config error: parallel.tp=4 makes tp*cp*pp=4"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "run")
    small = check("cluster.nodes=1", "cluster.gpus_per_node=1")  # the cluster holds fewer GPUs than the world
    assert small.returncode == 2 and small.stderr.strip() == (
        "config error: cluster.nodes=1 holds 1 GPUs (cluster.gpus_per_node=1), fewer than the 2 ranks of WORLD_SIZE; "
        "use cluster.nodes=2, or leave it null to derive it"
    ), small.stderr


def test_settings_that_do_nothing_are_named(data_dir):
    """validation.notes: valid settings that do less than they seem to (Megatron warns of the first too); the run
    and --check print them as warnings. A default config has none."""
    from megatron_lite.validation import notes

    assert notes(load([f"data.path={data_dir}"], world_size=1)) == []
    cfg = load(
        [
            f"data.path={data_dir}",
            "parallel.sp=true",
            "train.steps=50",
            "optim.warmup_steps=100",
            "train.eval_interval=60",
            "train.eval_per_dataset=true",
            "train.recompute_every=2",
            "parallel.schedule=interleaved",
        ],
        world_size=1,
    )
    assert notes(cfg) == [
        "parallel.sp=true does nothing at parallel.tp=1 (it splits the sequence over the TP ranks)",
        "parallel.schedule=interleaved does nothing at parallel.pp=1 (it orders a pipeline's micro-batches)",
        "optim.warmup_steps=100 > train.steps=50: the run ends in its warmup, at a learning rate of 0.0005 "
        "(optim.lr=0.001)",
        "train.eval_per_dataset=true does nothing with one data.path (val_loss is that dataset's)",
        "train.recompute_every=2 does nothing without train.recompute=full (it is none)",
        "train.eval_interval=60 > train.steps=50: this run never evaluates",
    ]
    at_tp2 = load(
        [
            f"data.path={data_dir}",
            "parallel.tp=2",
            "parallel.sp=true",
            "train.steps=50",
            "optim.warmup_steps=50",
            "train.eval_interval=50",
        ],
        world_size=2,
    )
    assert notes(at_tp2) == []  # sp splits at tp 2; warmup ends at the last step; it evaluates at step 50


def test_nvme_offload_without_async_io_is_refused_in_one_line(data_dir, monkeypatch):
    """A machine without libaio (simulated: `make test` installs it, so the real op builds in CI)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ConfigError, match=r"^zero.offload_param=nvme needs DeepSpeed's async_io op.*libaio"):
        load([f"data.path={data_dir}", "zero.stage=3", "zero.offload_param=nvme"], world_size=1)  # validation.check


def test_data_tokenizer_larger_than_the_model_vocabulary(data_dir):
    prepared(data_dir, tokenizer="assets/tokenizers/gpt2", vocab=50257)
    with pytest.raises(ConfigError, match=r"^model.vocab_size=8192 is smaller than data.path="):
        load([f"data.path={data_dir}"], world_size=1)


def test_resume_with_another_model_shape_or_unconvertible_layout_is_refused(data_dir, tmp_path):
    import json

    import torch

    step = tmp_path / "ckpt" / "step_0000004"
    step.mkdir(parents=True)
    cfg = load([f"data.path={data_dir}"], world_size=1)
    from dataclasses import asdict

    def write(zero_stage: int, **extra) -> None:
        meta = {
            "kind": "deepspeed",
            "step": 4,
            "config": {"model": asdict(cfg.model)},
            "layout": {"zero_stage": zero_stage, "dp": 1, "world_size": 1},
            **extra,
        }
        (step / "meta.json").write_text(json.dumps(meta))

    write(0)
    (tmp_path / "ckpt" / "latest").write_text("step_0000004")
    args = [f"data.path={data_dir}", f"checkpoint.dir={tmp_path}/ckpt"]
    with pytest.raises(ConfigError, match=r"^model.n_layers=6 differs from the checkpoint"):
        load(args + ["model.n_layers=6"], world_size=1)
    with pytest.raises(
        ConfigError,
        match=r"^model.n_layers=6, model.d_model=64, model.seq_len=64 differ from the "
        r"checkpoint \S+ \(model.n_layers=4 model.d_model=128 model.seq_len=128\); "
        r"use model.n_layers=4 model.d_model=128 model.seq_len=128, or",
    ):
        load(args + ["model.n_layers=6", "model.d_model=64", "model.seq_len=64"], world_size=1)
    # Every stage converts to and from every other, at any DP, TP or pipeline layout (our loaders,
    # engine/repairs/universal_load.py). A tp=1 ZeRO 1-2 checkpoint written before checkpoints recorded their TP split
    # patterns (2026-11-28; DeepSpeed's loader cut by them) loads at tp 2 too: ours cuts as the model builds.
    assert load(args + ["zero.stage=3"], world_size=1).zero.stage == 3
    assert load(args + ["zero.stage=2", "parallel.tp=2"], world_size=2).zero.stage == 2
    assert load(args + ["zero.stage=0", "parallel.pp=2", "parallel.schedule=gpipe"], world_size=2).parallel.pp == 2
    write(1)
    assert load(args + ["zero.stage=1", "parallel.tp=2"], world_size=2).parallel.tp == 2
    assert load(args + ["zero.stage=0", "parallel.tp=2"], world_size=2).parallel.tp == 2
    assert load(args + ["zero.stage=2", "parallel.tp=2"], world_size=2).parallel.tp == 2
    assert load(args + ["zero.stage=1", "parallel.tp=2", "parallel.pp=2"], world_size=4).parallel.pp == 2
    cfg = load([f"data.path={data_dir}", "model=llama-tiny"], world_size=1)
    write(0)  # RoPE computes its tables for any length: a llama resumes (or fine-tunes an import) at another seq_len
    assert load(args + ["model=llama-tiny", "model.seq_len=64"], world_size=1).model.seq_len == 64
    write(3)  # ZeRO-3 resumes at another tp, and ZeRO-0 resumes it (our loaders, engine/repairs/universal_load.py)
    assert load(args + ["model=llama-tiny", "zero.stage=3", "parallel.tp=2"], world_size=2).parallel.tp == 2
    assert (
        load(
            args + ["model=llama-tiny", "zero.stage=0", "parallel.pp=2", "parallel.schedule=gpipe"], world_size=2
        ).parallel.pp
        == 2
    )
    for stage in (1, 2):  # our loaders read the universal form whatever stage wrote it
        assert load(args + ["model=llama-tiny", f"zero.stage={stage}"], world_size=1).zero.stage == stage
    write(2)
    assert load(args + ["model=llama-tiny", "zero.stage=3"], world_size=1).zero.stage == 3
    # An NVMe-offloaded optimizer resumes through the universal form from the swap files its ranks recorded
    # (engine/repairs/nvme_checkpoint.py); one written before they recorded them cannot
    write(3, config={"model": asdict(cfg.model), "zero": {"offload_optimizer": "nvme"}})
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.resume: \S+ was written with zero.offload_optimizer=nvme by "
        r"an older version, which did not record where its swapped optimizer",
    ):
        load(args + ["model=llama-tiny", "zero.stage=3"], world_size=1)
    from megatron_lite.checkpoint.weights import load_model_state  # nor export it (DeepSpeed's message was unclear)

    with pytest.raises(ValueError, match=r"zero.offload_optimizer=nvme by a version that did not record where its "):
        load_model_state(str(step))
    torch.save(
        {
            "optim_states": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "folder": "offloaded_tensors/rank00",
            "swapped": {},
        },
        tmp_path / "ckpt" / "step_0000004" / "offload_rank00000.pt",
    )
    assert load(args + ["model=llama-tiny", "zero.stage=3"], world_size=1).zero.stage == 3


def test_a_gpu_without_float8_is_refused_in_one_line(monkeypatch, data_dir):
    """Before any process starts: an A100 (8.0) cannot run torch._scaled_mm, and rowwise needs bf16 on a GPU."""
    import torch

    import megatron_lite.validation.train as train_checks

    monkeypatch.setattr(train_checks, "has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(
        ConfigError, match=r"^train.fp8=rowwise needs a GPU of compute capability 8.9 .* this one is 8.0;"
    ):
        load([f"data.path={data_dir}", "train.fp8=rowwise"], world_size=1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ConfigError, match=r"^train.fp8=rowwise needs bf16 on a GPU .*; use train.precision=bf16"):
        load([f"data.path={data_dir}", "train.fp8=rowwise", "train.precision=fp32"], world_size=1)
    load([f"data.path={data_dir}", "train.fp8=tensorwise", "train.precision=fp32"], world_size=1)
