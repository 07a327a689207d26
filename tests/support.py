"""Small helpers shared by the integration, CLI, controller and reliability tests."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_module(path: Path | str, name: str | None = None) -> ModuleType:
    """Import a script by path (an example under ``examples/`` when given a bare name), once per session."""
    path = Path(path) if str(path).endswith(".py") else ROOT / "examples" / f"{path}.py"
    name = name or path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def collection_values(batches: list[dict[str, Any]], **options: Any) -> dict[str, float]:
    """The scalar values of a fresh OPBCCollection(**options) fed ``batches`` one update each."""
    from opbc_metrics import OPBCCollection

    metrics = OPBCCollection(**options)
    for b in batches:
        metrics.update(b)
    return {k: v.item() for k, v in metrics.compute().items() if v.numel() == 1}


def assert_values_close(got: dict[str, Any], want: dict[str, Any], rel: float = 1e-9, abs_: float = 1e-12) -> None:
    """The same keys, and every value (float or one-element tensor) within the tolerances."""
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        a, b = (float(x.item() if isinstance(x, torch.Tensor) else x) for x in (got[key], value))
        assert math.isclose(a, b, rel_tol=rel, abs_tol=abs_) or (math.isnan(a) and math.isnan(b)), (key, a, b)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since its last reset: a compiled path that fell back to eager compiles none, and
    a test comparing it with eager would compare eager with eager."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# A well-formed sample of the CLI's JSONL schema (three tokens).
GOOD_SAMPLE = {"trainer_logprobs": [-1.0, -0.5, -2.0], "rollout_logprobs": [-1.1, -0.5, -1.9]}


def analyze_cli(path: Path, out: Path, *options: str) -> tuple[int, dict | None, str]:
    """``opbc-metrics analyze path --out out --no-html *options`` in process: (exit status, result.json or None,
    stderr)."""
    import contextlib
    import io
    import json

    from opbc_metrics.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = main(["analyze", str(path), "--out", str(out), "--no-html", *options])
    result = out / "result.json"
    return status, json.loads(result.read_text()) if result.exists() else None, err.getvalue()
