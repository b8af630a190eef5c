"""data.document_mask on one process: where documents begin, and the model with the mask against each document
run alone (the defining property), for both flavours and both kernel backends."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.data.dataset import WindowDataset
from megatron_lite.data.documents import Windows, positions_from_eos, positions_from_starts, stack
from megatron_lite.model.gpt import GPT
from tests.unit.test_model import GPT2, LLAMA

EOS = 0


def _stream(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Documents of these lengths (their eos included), joined: (tokens, index of document starts)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 1000, n - 1), EOS) for n in lengths]
    starts = np.cumsum([0, *lengths[:-1]])
    return np.concatenate(docs).astype(np.uint16), starts.astype(np.int64)


def test_positions_from_the_index_and_from_eos_agree():
    tokens, starts = _stream([5, 9, 1, 30, 3, 40, 12])
    for start in (0, 3, 13, 14, 47, 60):
        window = tokens[start : start + 33].astype(np.int64)
        by_index = positions_from_starts(start, len(window), starts)
        np.testing.assert_array_equal(by_index, positions_from_eos(window, EOS))
    # the window from 3: the rest of the first document (2 tokens), then 9, 1, 30 (cut at 33 tokens)
    np.testing.assert_array_equal(positions_from_starts(3, 33, starts)[:14], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 1])


def test_an_eos_inside_a_document_is_no_boundary_with_the_index():
    tokens, starts = _stream([6, 10])
    tokens[2] = EOS  # a document whose text holds the end-of-document token
    by_index = positions_from_starts(0, 16, starts)
    np.testing.assert_array_equal(by_index, [*range(6), *range(10)])
    assert positions_from_eos(tokens.astype(np.int64), EOS)[3] == 0  # the tokens alone split it there


def test_window_dataset_pairs_and_micro_batch_counts():
    tokens, starts = _stream([5, 9, 1, 30, 3, 40, 12])
    plain, docs = WindowDataset(tokens, 16), WindowDataset(tokens, 16, doc_starts=starts)
    t, p = docs[1]
    assert torch.equal(t, plain[1]) and p.shape == t.shape and p[0] == 0
    batch = stack([docs[0], docs[1]])
    assert isinstance(batch, Windows) and batch.tokens.shape == (2, 17)
    # documents start at 0, 5, 14, 15, 45: window 0 (tokens 0-16) predicts all labels but tokens 5, 14 and 15;
    # window 1 (tokens 16-32) lies in one document
    assert batch.predicted() == 13 + 16
    # the inputs' documents (16 inputs a window): 5, 9, 1, 1 and 16
    assert batch.attended() == 25 + 81 + 1 + 1 + 256


def _documents_alone(model, tokens: torch.Tensor, positions: torch.Tensor):
    """Per-token losses of each document of the window run as a sequence of its own (labels that begin a
    document are not predicted): (losses, which labels are predicted)."""
    starts = [*torch.nonzero(positions[:-1] == 0).flatten().tolist(), len(positions) - 1]
    losses = []
    for a, b in zip(starts[:-1], starts[1:]):
        doc = tokens[a : b + 1]  # its inputs and the label after its last input
        logits = model(doc[None, :-1])[0]
        losses.append(F.cross_entropy(logits, doc[1:], reduction="none"))
    return torch.cat(losses) * (positions[1:] != 0)  # a last label that begins the next document: not predicted


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_masked_window_equals_each_document_alone(kw, backend, monkeypatch):
    """The defining property: with the mask, a window of several documents gives each document's per-token
    losses and the gradients of running each document alone (fp32)."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw))
    model.set_kernels(backend)
    tokens, starts = _stream([7, 3, 12, 20, 2, 40], seed=1)
    dataset = WindowDataset(tokens, 32, doc_starts=starts)
    windows = stack([dataset[0], dataset[1]])
    alone = torch.stack([_documents_alone(model, *dataset[i]) for i in range(2)])  # (2, 32)
    predicted = windows.positions[:, 1:] != 0
    assert predicted.sum() < predicted.numel() and (alone[~predicted] == 0).all()

    logits = model(windows.tokens[:, :-1], documents=windows)
    masked = F.cross_entropy(logits.flatten(0, 1), windows.tokens[:, 1:].flatten(), reduction="none").view(2, 32)
    torch.testing.assert_close(masked * predicted, alone, rtol=1e-5, atol=1e-6)

    windows.loss_tokens = float(predicted.sum())
    loss = model(windows.tokens[:, :-1], windows.tokens[:, 1:], documents=windows)
    torch.testing.assert_close(loss, alone.sum() / predicted.sum(), rtol=1e-6, atol=0)
    masked_grads = torch.autograd.grad(loss, list(model.parameters()))
    reference = torch.autograd.grad(alone.sum() / predicted.sum(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), masked_grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
    # and without the mask the same windows give other losses
    plain = model(windows.tokens[:, :-1], windows.tokens[:, 1:])
    assert abs(plain.item() - loss.item()) > 1e-3


def test_mfu_counts_the_attention_within_documents():
    """step_flops(attended=...): the attention core counts the documents' length² instead of windows x s²; a
    window that is one document counts as the causal window, and the dense part does not change."""
    from megatron_lite.metrics.flops import layer_flops_per_token, step_flops

    cfg = ModelConfig(**GPT2)
    s, windows = cfg.seq_len, 4
    tokens = windows * s
    assert step_flops(cfg, tokens, attended=windows * s * s) == step_flops(cfg, tokens)
    lengths = [s // 4] * 4 * windows  # four documents a window: a quarter of the attention work
    dense, core = layer_flops_per_token(cfg, s)
    full, _ = step_flops(cfg, tokens)
    masked, _ = step_flops(cfg, tokens, attended=sum(n * n for n in lengths))
    assert masked == pytest.approx(full - 3 * cfg.n_layers * core * tokens * 3 / 4, rel=1e-12)
    recomputed = step_flops(cfg, tokens, "selective", attended=sum(n * n for n in lengths))
    assert recomputed[1] - recomputed[0] == pytest.approx(cfg.n_layers * core * tokens / 4, rel=1e-12)


def test_bench_documents_runs(tmp_path):
    """tools/bench_documents.py --quick writes its record: the three attention cases, both step cases, and ring
    blocks skipped (never more than there are)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "documents.json"
    cmd = [sys.executable, "tools/bench_documents.py", "--quick", "--heads", "2", "--head-dim", "16", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    assert set(record["attention_ms"]) == {"causal", "dense mask", "per document"}
    assert set(record["step_ms"]) == {"causal", "document mask"} and 0 < record["attention_share"] < 1
    assert all(0 <= c["skipped"] <= c["of"] for c in record["ring_blocks"].values())
    assert record["ring_blocks"]["cp4, one window"]["skipped"] > 0
