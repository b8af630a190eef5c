"""tools/plot_run.py: the four panels from metrics.jsonl, a run still writing its last line, and one-line errors."""

import json

import pytest

from tools.plot_run import plot


def rows(n: int) -> list[dict]:
    return [
        {
            "step": s,
            "loss": 9.0 - s / 10,
            "lr": 1e-3,
            "tokens_per_s": 1000.0,
            "mfu": 0.3,
            "hfu": 0.3,
            **({"val_loss": 8.5, "val_loss/data/a": 8.4, "val_loss/data/b": 8.6} if s % 2 == 0 else {}),
        }
        for s in range(1, n + 1)
    ]


def test_plots_a_run_and_ignores_a_half_written_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(5)) + '{"step": 6, "lo')
    out = plot(str(tmp_path))
    assert out.endswith("metrics.png") and (tmp_path / "metrics.png").stat().st_size > 10_000


def test_a_missing_run_or_a_broken_line_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^plot_run: \S+/metrics.jsonl does not exist; give a run.dir"):
        plot(str(tmp_path / "nope"))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows(1)[0]) + "\nnot json\n" + json.dumps(rows(2)[1]) + "\n")
    with pytest.raises(SystemExit, match=r"line 2 is not JSON"):
        plot(str(tmp_path))
