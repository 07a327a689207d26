"""The README's W&B and Lightning snippets (examples/readme_*.py) run as written, as a user runs them
(``python examples/readme_wandb.py`` in an empty folder), and write what they promise."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = ("readme_wandb.py", "readme_lightning.py")


def run_snippet(name: str, cwd: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("name", SNIPPETS)
def test_snippets_fit_in_ten_lines(name: str):
    lines = [line for line in (ROOT / "examples" / name).read_text().splitlines() if line.strip()]
    assert len(lines) <= 10, name


def test_readme_wandb_snippet(tmp_path: Path):
    pytest.importorskip("wandb")
    from tests.wandb_run import read_offline_run

    run_snippet("readme_wandb.py", tmp_path)
    rows = [r for r in read_offline_run(tmp_path)["history"] if "opbc/is/ess" in r]
    assert [r["opbc/step"] for r in rows] == list(range(10))
    for row in rows:
        assert 0.99 < row["opbc/is/ess"] <= 1.0
        assert 0.004 < row["opbc/logprob/abs_diff_mean"] < 0.006  # E|0.01 U(0, 1)| = 0.005
        assert "opbc/log_ratio/max_abs" not in row  # = opbc/logprob/abs_diff_max, written once


def test_readme_lightning_snippet(tmp_path: Path):
    pytest.importorskip("lightning")
    run_snippet("readme_lightning.py", tmp_path)
    (path,) = tmp_path.glob("lightning_logs/version_0/metrics.csv")  # Lightning's default logger here (CSV)
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("opbc/is/ess")]
    assert [int(r["step"]) for r in rows] == [15, 31, 47, 63]  # every 16 of BoringModel's 64 batches
    for row in rows:
        # r = logp - 1.01 logp = -0.01 logp >= 0 on every token: mean |r| = mean r
        assert float(row["opbc/logprob/abs_diff_mean"]) == pytest.approx(float(row["opbc/logprob/diff_mean"]))
        assert 0.0 < float(row["opbc/logprob/abs_diff_mean"]) < 0.05
        assert 0.9 < float(row["opbc/is/ess"]) <= 1.0
    assert not any(k.endswith("_epoch") for k in rows[0]) and "opbc/log_ratio/max_abs" not in rows[0]


@pytest.mark.parametrize("tag,name", [("lightning", "readme_lightning.py"), ("wandb", "readme_wandb.py"),
                                      ("trl", "readme_trl.py"), ("verl", "readme_verl.py")])
def test_readme_quotes_the_tested_snippet(tag: str, name: str):
    """The README's integration blocks are the example files these tests run (docstring aside)."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- {tag}-example: examples/{name} -->\n```python\n(.*?)\n```\n<!-- /{tag}-example -->",
                      readme, re.S)
    assert block is not None, f"README has no {tag} block quoting examples/{name}"
    code = (ROOT / "examples" / name).read_text()
    code = re.sub(r'^\s*""".*?"""\n+', "", code, flags=re.S).strip("\n")
    assert block.group(1) == code
