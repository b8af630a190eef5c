"""Keyed initialisation and building on the meta device, in one process (no TP: see
tests/distributed/test_model_build.py for TP shards and ZeRO-3 partitions).

The keyed init makes each parameter a function of (seed, its name) alone; a pipeline rank that builds only its
chunks on the meta device and materialises them must hold bitwise what it would hold after building the whole
model and cutting it (GPT.keep_chunks), which is the route the trainer took before."""

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.model.init import init_tensor, param_seed
from megatron_lite.pipeline.partition import rank_chunks
from tests.utils.models import LLAMA_STYLE

GPT2 = dict(n_layers=4, n_heads=4, d_model=64, vocab_size=1000, seq_len=32)
LLAMA = dict(
    GPT2,
    n_kv_heads=2,
    ffn_hidden=96,
    **LLAMA_STYLE,
)
FLAVOURS = {"gpt2": GPT2, "llama": LLAMA}


def assert_same_model(got: GPT, want: GPT) -> None:
    """Same parameter names, shapes, bits and TP marks; same buffers; nothing left on the meta device."""
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert list(got_p) == list(want_p)
    for name, p in got_p.items():
        assert not p.is_meta and p.requires_grad, name
        assert p.dtype == want_p[name].dtype and torch.equal(p, want_p[name]), name
        assert getattr(p, "tensor_model_parallel", False) == getattr(want_p[name], "tensor_model_parallel", False)
    got_b, want_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert list(got_b) == list(want_b)
    for name, b in got_b.items():
        assert not b.is_meta and torch.equal(b, want_b[name]), name


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_same_seed_same_model_and_the_global_stream_untouched(flavour):
    cfg = ModelConfig(**FLAVOURS[flavour])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a, b = GPT(cfg, seed=5), GPT(cfg, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # building draws nothing from the default generator
    assert_same_model(a, b)
    other = dict(GPT(cfg, seed=6).named_parameters())
    for name, p in a.named_parameters():
        if p.dim() > 1:
            assert not torch.equal(p, other[name]), name


def test_init_follows_gpt2_rules():
    cfg = ModelConfig(**dict(GPT2, n_layers=8))
    model = GPT(cfg, seed=1)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        else:
            rows = p[: cfg.vocab_size] if name == "wte.weight" else p
            std = 0.02 / 4 if name.endswith(("attn.proj.weight", "mlp.fc_out.weight")) else 0.02  # 1/sqrt(2*8)
            assert abs(rows.std().item() / std - 1) < 0.1 and abs(rows.mean().item()) < 1e-3, name
    assert torch.equal(model.wte.weight[cfg.vocab_size :], torch.zeros(1024 - 1000, 64))  # padding starts at zero


def test_a_parameter_depends_only_on_seed_and_name():
    """The same name gets the same tensor whatever else the model holds (a tied or untied head, more heads);
    different names get independent streams."""
    tied = GPT(ModelConfig(**GPT2), seed=9)
    untied = GPT(ModelConfig(**dict(GPT2, tie_embeddings=False)), seed=9)
    for name, p in tied.named_parameters():
        assert torch.equal(p, dict(untied.named_parameters())[name]), name
    assert torch.equal(
        tied.blocks[2].attn.qkv.weight, init_tensor("blocks.2.attn.qkv.weight", (192, 64), tied.cfg, seed=9)
    )
    assert not torch.equal(tied.blocks[0].mlp.fc_in.weight, tied.blocks[1].mlp.fc_in.weight)
    assert len({param_seed(s, n) for s in range(3) for n, _ in untied.named_parameters()}) == 3 * len(
        list(untied.named_parameters())
    )


def test_param_seed_is_a_fixed_function_of_seed_and_name():
    """blake2b of (seed, name), not Python's per-process hash(): every rank, started whenever, draws the same
    stream. A changed value here changes every initial weight (and the recorded loss curves)."""
    assert param_seed(1234, "blocks.7.attn.qkv.weight") == 0xC9D49E43DF930D3A


def test_padded_rows_do_not_move_real_rows():
    """tp changes the padding (vocabulary rounded to vocab_multiple * tp), never the rows of real tokens."""
    kw = dict(GPT2, vocab_multiple=48, tie_embeddings=False)
    one, four = GPT(ModelConfig(**kw), tp=1, seed=2), GPT(ModelConfig(**kw), tp=4, seed=2)
    assert one.wte.weight.shape[0] == 1008 and four.wte.weight.shape[0] == 1152
    for attr in ("wte", "lm_head"):
        w1, w4 = getattr(one, attr).weight, getattr(four, attr).weight
        assert torch.equal(w1[:1000], w4[:1000]) and w4[1000:].abs().max() == 0


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("pp,vpp,pp_layers", [(2, 1, None), (2, 2, None), (3, 1, [0, 3, 1])])
def test_meta_build_of_pipeline_chunks_equals_cutting_the_full_model(flavour, pp, vpp, pp_layers):
    cfg = ModelConfig(**FLAVOURS[flavour])
    for pp_rank in range(pp):
        chunks = rank_chunks(pp_rank, pp, vpp, cfg.n_layers, pp_layers)
        built = GPT(cfg, seed=4, device="meta").keep_chunks(chunks)
        assert all(p.is_meta for p in built.parameters())
        built.materialize()
        assert_same_model(built, GPT(cfg, seed=4).keep_chunks(chunks))


def test_materialize_in_bf16_rounds_the_fp32_init():
    cfg = ModelConfig(**LLAMA)
    chunks = rank_chunks(1, 2, 1, cfg.n_layers)
    got = GPT(cfg, seed=4, device="meta").keep_chunks(chunks).materialize(dtype=torch.bfloat16)
    for name, p in GPT(cfg, seed=4).keep_chunks(chunks).named_parameters():
        assert torch.equal(dict(got.named_parameters())[name], p.to(torch.bfloat16)), name


def test_reset_parameters_redraws_the_keyed_init_in_place():
    cfg = ModelConfig(**GPT2)
    model = GPT(cfg, seed=3).keep_chunks(rank_chunks(0, 2, 1, cfg.n_layers))
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    model.reset_parameters()
    assert all(a is b for a, b in zip(params, model.parameters()))  # same Parameter objects (optimizers keep them)
    assert_same_model(model, GPT(cfg, seed=3).keep_chunks(rank_chunks(0, 2, 1, cfg.n_layers)))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_materialize_from_a_full_state_dict_takes_this_ranks_part(flavour):
    """Weights-only checkpoints: each rank takes its tensors from the full state dict, no whole model built."""
    cfg = ModelConfig(**FLAVOURS[flavour])
    source = GPT(cfg, seed=11)
    weights = {k: v.clone() for k, v in source.state_dict().items()}
    chunks = rank_chunks(1, 2, 1, cfg.n_layers)
    got = GPT(cfg, seed=0, device="meta").keep_chunks(chunks).materialize(weights=weights)
    assert_same_model(got, GPT(cfg, seed=11).keep_chunks(chunks))
    del weights["blocks.0.attn.qkv.weight"]  # held by pipeline rank 0 only: still refused, as strict loading does
    with pytest.raises(RuntimeError, match="missing .'blocks.0.attn.qkv.weight'"):
        GPT(cfg, device="meta").keep_chunks(chunks).materialize(weights=weights)


def test_compile_blocks_compiles_every_block_in_place():
    """train.compile: each block's body is compiled in place (names, parameters and hooks unchanged); one graph
    for all blocks is checked in tests/unit/test_model.py, the trajectory against eager in
    tests/distributed/test_compile.py."""
    model = GPT(ModelConfig(name="t", n_layers=3, n_heads=4, d_model=32, vocab_size=300, seq_len=16))
    names = [name for name, _ in model.named_parameters()]
    model.compile_blocks()
    assert all(
        getattr(block.compute, "_torchdynamo_orig_callable", None) is not None for block in model.blocks.values()
    )
    assert [name for name, _ in model.named_parameters()] == names
