"""The GPT model on its own: flavours, GQA, padded vocabulary, causality, initialisation."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT, padded_vocab_size
from megatron_lite.model.positions import apply_rope, rope_cos_sin
from tests.utils.models import LLAMA_STYLE

GPT2 = dict(n_layers=2, n_heads=4, d_model=64, vocab_size=1000, seq_len=32)
LLAMA = dict(
    GPT2,
    n_kv_heads=2,
    ffn_hidden=96,
    **LLAMA_STYLE,
)


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_loss_is_cross_entropy_of_logits(kw):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw))
    tokens = torch.randint(0, 1000, (2, 33))
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 32, 1000)  # the true vocabulary, not the padded one
    loss = model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
    assert abs(loss.item() - math.log(1000)) < 0.5  # near-uniform at init


def test_vocab_is_padded_and_padding_never_scored():
    cfg = ModelConfig(**GPT2)
    assert padded_vocab_size(cfg) == 1024 and padded_vocab_size(cfg, tp=4) == 1024
    assert padded_vocab_size(ModelConfig(**dict(GPT2, vocab_size=1025)), tp=2) == 1152
    model = GPT(cfg)
    assert model.wte.weight.shape[0] == 1024 and model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == 1000
    tokens = torch.randint(0, 1000, (1, 9))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert model.wte.weight.grad[1000:].abs().max() == 0  # padded rows get no gradient


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_causal(kw):
    """Changing a future token changes no earlier position's logits."""
    model = GPT(ModelConfig(**kw)).eval()
    a = torch.randint(0, 1000, (1, 16))
    b = a.clone()
    b[0, 10] = (b[0, 10] + 1) % 1000
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10], rtol=0, atol=0)
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_gqa_equals_attention_with_repeated_kv_heads():
    """A GQA model equals the MHA model whose K/V heads are copies of each group's shared head."""
    torch.manual_seed(0)
    gqa = GPT(ModelConfig(**LLAMA))
    mha = GPT(ModelConfig(**dict(LLAMA, n_kv_heads=4)))
    sd = gqa.state_dict()
    hd, h, kv = 16, 4, 2
    for i in range(2):
        w = sd[f"blocks.{i}.attn.qkv.weight"]
        q, k, v = w.split([h * hd, kv * hd, kv * hd])
        rep = lambda t: t.view(kv, hd, -1).repeat_interleave(h // kv, dim=0).reshape(h * hd, -1)  # noqa: E731
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 1000, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_with_relative_positions():
    cos, sin = rope_cos_sin(8, 16, 10000.0)
    q, k = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # norms kept
    # <R_m q, R_n k> depends on m - n only: same vectors at shifted positions give the same score
    q0, k0 = q[:, :, :1].expand(1, 1, 8, 16), k[:, :, :1].expand(1, 1, 8, 16)
    s = (apply_rope(q0, cos, sin)[0, 0, 1:] * apply_rope(k0, cos, sin)[0, 0, :-1]).sum(-1)
    torch.testing.assert_close(s, s[:1].expand_as(s), rtol=1e-5, atol=1e-5)


def test_init_is_seeded_and_scaled():
    torch.manual_seed(3)
    a = GPT(ModelConfig(**dict(GPT2, n_layers=8)))
    torch.manual_seed(3)
    b = GPT(ModelConfig(**dict(GPT2, n_layers=8)))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert abs(a.blocks[0].attn.proj.weight.std().item() - 0.02 / 4) < 1e-3  # 0.02 / sqrt(2 * 8)
    assert abs(a.blocks[0].attn.qkv.weight.std().item() - 0.02) < 2e-3
    assert torch.equal(a.blocks[0].norm1.weight, torch.ones(64))


def test_compiled_blocks_share_one_graph_and_follow_eager():
    """train.compile (GPT.compile_blocks) on 10 blocks, more than torch.compile's recompile limit of 8: every
    block runs one shared graph with no graph break, and loss and gradients follow the eager model. Compiling
    whole blocks specialised on each block's layer index (8 graphs, blocks 8 and 9 left eager), and resolving
    each op's function by importlib inside the block broke the graph at every norm and activation."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = ModelConfig(**dict(GPT2, n_layers=10))
    eager, compiled = GPT(cfg), GPT(cfg)  # the same seed, so the same weights
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_blocks()
    tokens = torch.randint(0, 1000, (2, 33))
    losses = []
    for model in (eager, compiled):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
        dict(counters["stats"]),
        dict(counters["graph_break"]),
    )
    # Inductor fuses and reorders fp32 arithmetic: relative differences of a few 1e-7 (stated tolerance 1e-5).
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6 * p.grad.abs().max().item(), msg=name)


def test_compiled_blocks_with_dropout_compile_independently_of_depth():
    """With dropout the compiled blocks break the graph at the keyed mask draws, whose keys hold the layer
    index: the graphs compiled for 3 blocks and for 10 (past torch.compile's recompile limit of 8) over 2
    steps are the same ones. Compiling whole blocks specialised on the layer index: 8 compiles, then eager."""
    from torch._dynamo.utils import counters

    graphs = []
    for n_layers in (3, 10):
        torch._dynamo.reset()
        counters.clear()
        model = GPT(ModelConfig(**dict(GPT2, n_layers=n_layers, dropout=0.1))).train()
        model.compile_blocks()
        tokens = torch.randint(0, 1000, (2, 33))
        for step in range(2):
            model(tokens[:, :-1], tokens[:, 1:], rng_key=(step, 0)).backward()
        graphs.append(dict(counters["stats"]))
    assert graphs[0] == graphs[1], graphs


def test_tied_stand_in_hands_its_gradient_over_and_keeps_none():
    """A pipeline's tied embedding (model/tied.py): each micro-batch's stand-in leaf adds its gradient to the fp32
    accumulator and keeps no copy. Autograd used to store it in the leaf's .grad as well, a weight-sized fp32
    tensor alive as long as the micro-batch's graph: under 1F1B, into the next micro-batch's backward (the last
    stage's peak, 4 MiB over the planner's at the tiny preset's 8192-token vocabulary)."""
    from megatron_lite.model.tied import TiedEmbedding

    weight = torch.nn.Parameter(torch.randn(10, 4))
    tied = TiedEmbedding(weight, embed_group=None, is_head_copy=False)
    x = torch.randn(3, 4)
    leaves = []
    for _ in range(2):  # two micro-batches, graphs kept alive
        leaves.append(tied.stand_in())
        (x @ leaves[-1].t()).square().sum().backward()
    assert all(leaf.grad is None for leaf in leaves)
    torch.testing.assert_close(tied.grad, 2 * torch.autograd.grad((x @ weight.t()).square().sum(), weight)[0])
    assert weight.grad is None
