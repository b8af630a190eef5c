"""Only a collective's own timeout counts as a stalled rank (issue 23): any other error that mentions a timeout is a
crash with its own traceback, not exit 4 after a grace wait."""

import pytest

from megatron_lite.faults.stalls import collective_timed_out

TIMEOUTS = [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
    "recv operation to complete",  # gloo, measured with a sleeping peer (torch 2.13)
    "Application timeout caused pair closure",  # gloo, the next collective on that pair (measured)
    "NCCL communicator was aborted on rank 3. Original reason for failure was: [Rank 3] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=300000) ran for "
    "300004 milliseconds before timing out.",
]
OTHERS = [
    "DataLoader timed out after 60 seconds",
    "timeout must be a positive number",
    "wait timeout after 30000ms, keys: /megatron_lite/x",  # a store's own timeout (rendezvous), not a collective
    "CUDA error: the launch timed out and was terminated",
]


@pytest.mark.parametrize("text", TIMEOUTS)
def test_collective_timeouts_are_recognised(text):
    assert collective_timed_out(RuntimeError(text))


@pytest.mark.parametrize("text", OTHERS)
def test_other_errors_that_mention_a_timeout_are_not(text):
    assert not collective_timed_out(RuntimeError(text))
    assert not collective_timed_out(ValueError(TIMEOUTS[0]))
