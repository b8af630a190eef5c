"""Checks every mapping in megatron_lite/parallel/mappings.py, forward and backward, against closed forms.

Run under torchrun (gloo); the whole world is the TP group. Every rank can compute every rank's inputs and
upstream gradients (they are seeded by rank), so the expected results are written out directly.
Exits non-zero with a message on the first mismatch. Exact equality except where a sum over ranks is
taken (fp32 addition order), where the tolerance is 1e-6.
"""

import sys

import torch
import torch.distributed as dist

from megatron_lite.parallel import mappings as M
from tests.distributed.rank_runner import leave_world

SHAPE = (2, 8, 12)  # (batch, seq, hidden); seq and hidden divide by 2 and 4


def tensor(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def check(name: str, got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    ok = torch.equal(got, want) if exact else torch.allclose(got, want, rtol=0, atol=1e-6)
    if not ok:
        sys.exit(f"{name}: rank {dist.get_rank()} max diff {(got - want).abs().max().item():.3e}")


def run_op(op, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = op(x, dist.group.WORLD)
    y.backward(grad)
    return y.detach(), x.grad


def main() -> None:
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    xs = [tensor(100 + i) for i in range(n)]  # rank i's input
    gs = [tensor(200 + i) for i in range(n)]  # rank i's upstream gradient (full shape)
    X, G = tensor(7), tensor(8)  # a tensor every rank holds identically
    total_x, total_g = sum(xs), sum(gs)
    hid, seq = SHAPE[-1] // n, SHAPE[1] // n

    y, dx = run_op(M.copy_to_tp, xs[r], gs[r])
    check("copy_to_tp fwd", y, xs[r], True)
    check("copy_to_tp bwd", dx, total_g, False)

    y, dx = run_op(M.reduce_from_tp, xs[r], gs[r])
    check("reduce_from_tp fwd", y, total_x, False)
    check("reduce_from_tp bwd", dx, gs[r], True)

    g_shards = [g[..., i * hid : (i + 1) * hid] for i, g in enumerate(gs)]
    y, dx = run_op(M.scatter_to_tp, X, g_shards[r])
    check("scatter_to_tp fwd", y, X[..., r * hid : (r + 1) * hid], True)
    check("scatter_to_tp bwd", dx, torch.cat(g_shards, dim=-1), True)

    x_shards = [x[..., :hid] for x in xs]
    y, dx = run_op(M.gather_from_tp, x_shards[r], G)
    check("gather_from_tp fwd", y, torch.cat(x_shards, dim=-1), True)
    check("gather_from_tp bwd", dx, G[..., r * hid : (r + 1) * hid], True)

    g_seq = [g[:, i * seq : (i + 1) * seq] for i, g in enumerate(gs)]
    y, dx = run_op(M.scatter_to_sp, X, g_seq[r])
    check("scatter_to_sp fwd", y, X[:, r * seq : (r + 1) * seq], True)
    check("scatter_to_sp bwd", dx, torch.cat(g_seq, dim=1), True)

    x_seq = [x[:, :seq] for x in xs]
    y, dx = run_op(M.gather_from_sp, x_seq[r], gs[r])
    check("gather_from_sp fwd", y, torch.cat(x_seq, dim=1), True)
    check("gather_from_sp bwd", dx, total_g[:, r * seq : (r + 1) * seq], False)

    y, dx = run_op(M.reduce_scatter_to_sp, xs[r], g_seq[r])
    check("reduce_scatter_to_sp fwd", y, total_x[:, r * seq : (r + 1) * seq], False)
    check("reduce_scatter_to_sp bwd", dx, torch.cat(g_seq, dim=1), True)

    # Ulysses' swap: rank r sends its seq shard of hidden chunk j to rank j and gathers the whole sequence of
    # hidden chunk r; backward sends the gradient's pieces back where they came from.
    a2a = lambda x, group: M.all_to_all(x, group, scatter_dim=-1, gather_dim=1)  # noqa: E731
    g_a2a = [g[..., i * hid : (i + 1) * hid] for i, g in enumerate(gs)]  # (b, seq, hid): rank i's upstream grad
    y, dx = run_op(a2a, x_seq[r], g_a2a[r])
    check("all_to_all fwd", y, torch.cat([x[..., r * hid : (r + 1) * hid] for x in x_seq], dim=1), True)
    check("all_to_all bwd", dx, torch.cat([g[:, r * seq : (r + 1) * seq] for g in g_a2a], dim=-1), True)

    # A one-rank group is the identity in both directions and builds no autograd node.
    solo = None
    for sub in range(n):  # every rank must take part in creating every group
        g = dist.new_group([sub])
        if sub == r:
            solo = g
    for op in (M.copy_to_tp, M.reduce_from_tp, M.gather_from_sp, M.reduce_scatter_to_sp, a2a):
        if op(xs[r], solo) is not xs[r]:
            sys.exit(f"{getattr(op, '__name__', op)} is not the identity on a one-rank group")
    leave_world()  # tests/distributed/rank_runner.py says why


if __name__ == "__main__":
    main()
