"""The planner's parts against the real model and the schedules, and `--check` / `--plan` end to end.

Memory measured on whole training steps (every rank, DeepSpeed included) is tests/distributed/
test_plan_validation.py; published throughput is test_plan_published.py. Here: exact equalities with no process
group -- the parameters a rank holds, every tensor a layer keeps for backward, the in-flight counts of every schedule
-- and that every layout the search yields passes validation.validate.
"""

import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from megatron_lite.cli import checked, compose_config, load
from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.layout import Layout
from megatron_lite.model.gpt import GPT
from megatron_lite.pipeline.partition import rank_chunks
from megatron_lite.pipeline.schedules import build_schedule
from megatron_lite.pipeline.simulate import expected_bubble, simulate
from megatron_lite.plan import activations as A
from megatron_lite.plan import cluster_from_config, predict
from megatron_lite.plan.params import rank_params
from megatron_lite.plan.schedule_memory import moments
from megatron_lite.plan.search import fixes, layouts
from megatron_lite.plan.timing import schedule_bubble
from tests.utils.models import LLAMA_STYLE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2 = dict(n_heads=4, d_model=64, vocab_size=500, seq_len=32)
LLAMA = dict(
    GPT2,
    n_kv_heads=2,
    ffn_hidden=96,
    **LLAMA_STYLE,
)


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2-tied", "llama-untied"])
@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_rank_params_are_the_built_models(kw, pp, vpp):
    """Name and size of every parameter each pipeline rank builds (meta device), in registration order."""
    cfg = ModelConfig(n_layers=8, **kw)
    for rank in range(pp):
        model = GPT(cfg, device="meta").keep_chunks(rank_chunks(rank, pp, vpp, cfg.n_layers))
        built = [(name, p.numel()) for name, p in model.named_parameters()]
        assert built == [(p.name, p.numel) for p in rank_params(cfg, 1, pp, vpp, rank)], (pp, vpp, rank)


def _saved_bytes(
    cfg: ModelConfig, recompute: str, b: int, dtype: torch.dtype, backend: str = "torch", fp8: str = "none"
) -> int:
    """Bytes of every distinct storage autograd keeps for backward over one forward (parameters, buffers excluded),
    with the kernels of `backend` (and train.fp8's float8 projections)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype).train()
    model.set_recompute(recompute)
    model.set_kernels(backend)
    model.set_fp8(fp8, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1))
    kept = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in kept and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return total[0]


def _assert_priced_to_the_byte(
    cfg: ModelConfig, recompute: str, dtype: torch.dtype, backend: str = "torch", fp8: str = "none"
) -> None:
    """One layer (a 3-layer model minus a 2-layer one) and the embedding + head (1 layer minus one layer) keep
    exactly what plan/activations.py prices for them."""
    b, act, triton = 2, 2 if dtype == torch.bfloat16 else 4, backend == "triton"
    x = A.MicroShape(
        b=b,
        s=cfg.seq_len,
        tp=1,
        sp=False,
        cp=1,
        cp_mode="ring",
        flash=cfg.dropout == 0,
        act=act,
        res=act,
        autocast=False,
        dropout=cfg.dropout > 0,
        stats=4 if triton else act,  # the Triton LayerNorm keeps fp32 statistics, as CUDA's does
        triton_ce=triton,
    )
    saved = functools.partial(_saved_bytes, recompute=recompute, b=b, dtype=dtype, backend=backend, fp8=fp8)
    layer = saved(dataclasses.replace(cfg, n_layers=3)) - saved(cfg)
    assert layer == A.layer_bytes(cfg, x, recompute)
    one = saved(dataclasses.replace(cfg, n_layers=1))
    assert one - layer == A.embedding_saved(cfg, x) + A.head_saved(cfg, x)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["flash", "math-sdpa"])
@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_activations_are_every_tensor_autograd_keeps(kw, dropout, dtype, recompute):
    """To the byte: CPU SDPA takes its fused flash kernel without dropout and its math path with it."""
    _assert_priced_to_the_byte(ModelConfig(n_layers=2, dropout=dropout, **kw), recompute, dtype)


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_activations_with_the_triton_kernels(kw, dtype, recompute):
    """The same count with kernels.backend=triton (Triton's interpreter on CPU), as the planner prices a GPU run
    (auto there picks the Triton cross entropy, which keeps the logits in their dtype where torch's path keeps an
    fp32 log-softmax, and fp32 norm statistics): to the byte."""
    _assert_priced_to_the_byte(ModelConfig(n_layers=2, **kw), recompute, dtype, "triton")


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_float8_keeps_what_high_precision_keeps(kw, dtype, recompute, fp8):
    """train.fp8 is priced with bf16's activations: torchao's matmul (parallel/fp8.py) keeps each projection's
    high-precision input and the weight parameter, as F.linear does, and no float8 copy: to the byte."""
    _assert_priced_to_the_byte(ModelConfig(n_layers=2, **kw), recompute, dtype, fp8=fp8)


def _fp8_prediction(fp8: str, gpu: str = "h100-sxm"):
    cfg = load(
        [
            "model=gpt-1.3b",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            f"cluster.gpu={gpu}",
            "train.precision=bf16",
            f"train.fp8={fp8}",
        ],
        world_size=1,
    )
    return predict(cfg.model, Layout.of_run(cfg, 1, cuda=True), cluster_from_config(cfg.cluster, 1))


def test_float8_is_priced_at_the_float8_rate_plus_torchaos_casts():
    """gpt-1.3b at 4 x 2048 on one H100, ZeRO-0: the blocks' GEMMs at 0.70 of the 1979 TFLOP/s float8 peak instead
    of 0.823 of 989 (the head stays bf16); torchao's casts as HBM passes, counted by hand here for one layer: forward
    5 bytes an element of the four projections' inputs (T(3h + f)) and 9 of their fp32 weights (4h^2 + 2hf), backward
    5 of twice their output gradients (T(5h + f)) and of the inputs again, and 9 of the weights again. Memory is
    bf16's, and an A100 (no float8) is refused in one line."""
    bf16, fp8 = _fp8_prediction("none"), _fp8_prediction("rowwise")
    assert fp8.ranks == bf16.ranks
    T, h, f, layers = 4 * 2048, 2048, 8192, 24
    gemm_flops = 3 * T * 2 * (4 * h * h + 2 * h * f) * layers  # forward and backward (twice), 2 FLOPs a MAC
    saved = gemm_flops / (0.823 * 989e12) - gemm_flops / (0.70 * 1979e12)
    assert bf16.step.compute_s - fp8.step.compute_s == pytest.approx(saved, rel=1e-9)
    inputs, grads, weights = T * (3 * h + f), T * (5 * h + f), 4 * h * h + 2 * h * f
    casts = layers * (inputs * 5 + weights * 9 + (2 * grads + inputs) * 5 + weights * 9)
    assert fp8.step.memory_s - bf16.step.memory_s == pytest.approx(casts / (3350e9 * 0.60), rel=1e-9)
    assert _fp8_prediction("tensorwise").step == fp8.step
    # rowwise_with_gw_hp: the weight gradients' GEMMs (a third of the FLOPs) in bf16, and none of their casts
    high = _fp8_prediction("rowwise_with_gw_hp").step
    assert high.compute_s - fp8.step.compute_s == pytest.approx(saved / 3, rel=1e-9)
    uncast = layers * (inputs + grads) * 5
    assert fp8.step.memory_s - high.memory_s == pytest.approx(uncast / (3350e9 * 0.60), rel=1e-9)
    with pytest.raises(ConfigError, match=r"^train.fp8=rowwise cannot run on cluster.gpu=a100-80gb, which has no"):
        _fp8_prediction("rowwise", "a100-80gb")


@pytest.mark.parametrize(
    "name, pp, vpp, m",
    [
        ("1f1b", 4, 1, 8),
        ("gpipe", 4, 1, 8),
        ("interleaved", 4, 2, 8),
        ("interleaved", 4, 2, 9),
        ("interleaved", 2, 3, 4),
    ],
)
def test_in_flight_moments_match_the_simulator(name, pp, vpp, m):
    """The most micro-batch-chunks a rank holds, from the walk of its order, equals the simulator's peak."""
    sim = simulate(build_schedule(name, pp, vpp, m), pp, vpp, m)
    for rank in range(pp):
        assert max(sum(x.held) for x in moments(name, pp, vpp, m, rank)) == sim.peak_in_flight[rank]


@pytest.mark.parametrize("name, pp, vpp, m", [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 4, 2, 6)])
def test_bubble_is_the_simulators_for_any_cost_ratio(name, pp, vpp, m):
    """schedule_bubble takes the simulator's figure whatever the forward/backward ratio (so one run serves all)."""
    schedule = build_schedule(name, pp, vpp, m)
    for b_cost in (1.0, 2.0, 3.5):
        assert simulate(schedule, pp, vpp, m, 1.0, b_cost).bubble == pytest.approx(schedule_bubble(name, pp, vpp, m))
    assert schedule_bubble(name, pp, vpp, m) == pytest.approx(expected_bubble(name, pp, vpp, m))


def test_every_searched_layout_passes_validation():
    """The search space (8 ranks, llama-tiny, 16 sequences) is a subset of what validation.validate accepts.
    Hydra takes ~0.13 s to compose a config, 40 s for the 312 layouts, so each layout's keys are merged into the
    base composed once (OmegaConf parses the values as Hydra's override grammar does for these plain ones); every
    16th layout is also loaded as train.py loads it, and must come out the same."""
    base = ["model=llama-tiny", "train.global_batch_size=16", "train.micro_batch_size=1"]
    composed = compose_config(base)
    found = list(layouts(checked(composed, 8).model, 16, 8, 8))
    assert len(found) > 100
    for k, lay in enumerate(found):
        cfg = checked(OmegaConf.merge(composed, OmegaConf.from_dotlist(lay.overrides())), 8)  # ConfigError if invalid
        if k % 16 == 0:
            assert cfg == load(base + lay.overrides(), world_size=8), lay.overrides()


def _train_py(*args, world: int = 1):
    env = dict(os.environ, WORLD_SIZE=str(world))
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_check_prints_one_line_and_refuses_a_layout_that_does_not_fit(tmp_path):
    ok = _train_py(
        "--check",
        "model=llama-7b",
        "parallel.tp=2",
        "parallel.sp=true",
        "zero.stage=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=256",
        "--json",
        f"{tmp_path}/ok.json",
        world=16,
    )
    assert ok.returncode == 0 and len(ok.stdout.strip().splitlines()) == 1, ok.stderr
    assert ok.stdout.startswith("layout: dp 8, tp 2 +sp") and "GiB per GPU" in ok.stdout and "MFU" in ok.stdout
    (row,) = json.loads((tmp_path / "ok.json").read_text())
    assert row["fits"] and (row["tp"], row["dp"], row["zero_stage"], row["micro_batch_size"]) == (2, 8, 2, 1)
    bad = _train_py("--check", "model=llama-7b", "zero.stage=0", "train.global_batch_size=128", world=16)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "GiB more than the" in bad.stderr and "fastest fix: " in bad.stderr


def test_check_refuses_a_bad_world_size_in_one_line():
    """WORLD_SIZE=0 was a ZeroDivisionError, abc a ValueError traceback, -1 blamed train.profile_ranks."""
    for world in ("0", "abc", "-1"):
        bad = _train_py("--check", "model=gpt-1.3b", world=world)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (world, bad.stderr[-800:])
        assert f"WORLD_SIZE={world} is not a number of ranks" in bad.stderr, bad.stderr


def test_fp32_is_priced_at_the_fp32_peak_the_trainer_runs_at():
    """The trainer leaves TF32 off (torch's default), so fp32 matmuls run at the CUDA-core peak, 19.5 TFLOP/s on an
    A100, and its MFU is taken against that (metrics/flops.peak_flops). Priced at the TF32 rate (half the bf16
    peak), gpt-1.3b at 16 x 2048 tokens would take 3.0 s a step, where its 2.8e14 FLOPs need 14 s at 100% of the
    fp32 peak."""
    cfg = load(
        ["model=gpt-1.3b", "train.precision=fp32", "cluster.gpu=a100-40gb", "train.micro_batch_size=1"], world_size=1
    )
    prediction = predict(cfg.model, Layout.of_run(cfg, 1, cuda=True), cluster_from_config(cfg.cluster, 1))
    flops = prediction.tflops_per_gpu * 1e12 * prediction.step.total_s
    assert prediction.step.total_s > flops / 19.5e12, prediction.step.total_s
    rates = cluster_from_config(cfg.cluster, 1).rates  # the A100's: GEMMs and attention at 0.65
    assert 0 < prediction.mfu <= max(rates.gemm, rates.attention) + 1e-9, prediction.mfu


def test_plan_ranks_layouts_and_writes_json(tmp_path):
    out = _train_py(
        "--plan",
        "model=gpt2-350m",
        "cluster.gpu=a100-40gb",
        "cluster.nodes=1",
        "train.global_batch_size=64",
        "--json",
        f"{tmp_path}/plan.json",
    )
    assert out.returncode == 0, out.stderr
    assert "layouts fit on 1 x 8 a100-40gb" in out.stdout and "train.global_batch_size=64" in out.stdout
    rows = json.loads((tmp_path / "plan.json").read_text())
    keys = {
        "tp",
        "pp",
        "vpp",
        "cp",
        "dp",
        "zero_stage",
        "recompute",
        "micro_batch_size",
        "schedule",
        "memory_gib",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "fits",
    }
    assert rows and all(keys <= set(r) and r["fits"] for r in rows)
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 8 for r in rows)


def test_json_needs_a_mode_and_a_path():
    assert _train_py("--check", "--json").returncode == 2
    stray = _train_py("train.steps=1", "--json", "x.json")
    assert stray.returncode == 2 and "--json goes with --check or --plan" in stray.stderr


def test_a_fix_applied_as_printed_gives_the_layout_it_priced():
    """--check's "fastest fix" names every setting it changes, a return to a default included (vpp back to 1,
    recompute back to none, the schedule back to auto, parameter offload off): the user's layout with the fix's
    overrides loads as exactly the layout the fix was priced for (a fix that names only what it turns on makes
    another layout, or an invalid config such as vpp 2 at pp 1)."""
    base = ["model=llama-7b", "train.global_batch_size=32", "train.micro_batch_size=1"]
    composed = compose_config(base)
    cfg = checked(composed, 8)
    cluster = cluster_from_config(cfg.cluster, 8)
    odd = [
        ["parallel.pp=4", "parallel.vpp=2", "zero.stage=2", "train.micro_batch_size=2"],
        ["parallel.tp=2", "parallel.pp=4", "parallel.schedule=gpipe", "zero.stage=1", "train.micro_batch_size=1"],
        [
            "zero.stage=3",
            "zero.offload_param=cpu",
            "zero.offload_optimizer=cpu",
            "train.micro_batch_size=4",
            "train.recompute=full",
            "train.recompute_every=2",
        ],
        ["parallel.tp=2", "zero.stage=1", "train.recompute=selective", "train.micro_batch_size=4"],
        ["parallel.cp=2", "parallel.cp_mode=ulysses", "zero.stage=0", "train.micro_batch_size=4"],
        ["zero.stage=0", "train.micro_batch_size=4"],
        ["parallel.tp=2", "zero.stage=1", "train.micro_batch_size=4"],
    ]
    searched = [lay.overrides() for lay in itertools.islice(layouts(cfg.model, 32, 8, 8), 7, None, 211)]
    fixed = 0
    for overrides in odd + searched:
        user = Layout.of_run(checked(OmegaConf.merge(composed, OmegaConf.from_dotlist(overrides)), 8), 8, cuda=True)
        prediction = predict(cfg.model, user, cluster)
        if prediction.fits:
            continue
        found = fixes(cfg.model, user, cluster)
        if not found:
            continue
        changes, priced = found[0]
        applied = checked(OmegaConf.merge(composed, OmegaConf.from_dotlist(overrides + changes)), 8)  # valid
        assert Layout.of_run(applied, 8, cuda=True) == priced.layout, (overrides, changes)
        fixed += 1
    assert fixed >= 8, fixed


def test_plan_pins_the_knobs_given_and_says_why_nothing_is_found(capsys):
    """--plan ranks only layouts with the searched settings given on the command line, refuses settings it does
    not search (they were ignored before), and explains an empty search in one line: the batch no replica
    count divides, or pins no layout has."""
    from megatron_lite.cli import main

    assert (
        main(
            [
                "--plan",
                "model=llama-7b",
                "cluster.nodes=1",
                "zero.stage=3",
                "parallel.tp=2",
                "train.global_batch_size=64",
            ]
        )
        == 0
    )
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:] if line[:3].strip().isdigit()]
    assert rows and all(r[1] == "2" and r[7] == "3" for r in rows), rows  # tp and zero columns
    assert main(["--plan", "model=llama-7b", "parallel.cp=0"]) == 2  # was: no layout of 8 GPUs has parallel.cp=0
    assert capsys.readouterr().err.strip() == (
        "config error: parallel.cp=0 must be >= 1; pin a size of 1 or more, or leave it out to search it"
    )
    assert main(["--plan", "model=llama-7b", "parallel.schedule=gpipe"]) == 2
    assert capsys.readouterr().err.strip() == (
        "config error: parallel.schedule=gpipe is not among what --plan searches (the schedule auto picks); leave it "
        "out, and `train.py --check` a layout with it"
    )
    assert main(["--plan", "model=llama-7b", "cluster.nodes=1", "parallel.pp=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "config error: no layout of 8 GPUs has parallel.pp=3; pin fewer settings, or none to rank every layout"
    )
    assert main(["--plan", "model=gpt-1.3b", "cluster.nodes=3", "train.global_batch_size=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("config error: no layout of 24 GPUs takes train.global_batch_size=1: ")
        and err.endswith("use train.global_batch_size=24, or another number of GPUs")
        and "\n" not in err
    )
