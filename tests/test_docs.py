"""Doctests of every public module, and the four-field glossary read from the classes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import opbc_metrics
import opbc_metrics.integrations
from opbc_metrics import glossary
from opbc_metrics.metric import OPBCMetric


def _modules() -> list[str]:
    names = ["opbc_metrics", "opbc_metrics.integrations"]
    for pkg in (opbc_metrics, opbc_metrics.integrations):
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


def _subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))}


def _all_metric_classes() -> list[type]:
    for name in _modules():
        importlib.import_module(name)
    return [c for c in _subclasses(OPBCMetric)
            if c.keys and c.__module__.startswith("opbc_metrics") and not c.__name__.startswith("_")]


def test_every_public_metric_has_a_four_field_glossary_entry():
    classes = _all_metric_classes()
    assert len(classes) >= 15
    rendered = glossary.glossary_dict()
    for cls in classes:
        entry = cls.glossary
        assert entry is not None, f"{cls.__name__} has no glossary entry"
        for field in ("what", "unit", "cap", "action"):
            assert getattr(entry, field).strip(), f"{cls.__name__}.glossary.{field} is empty"
        assert rendered[entry.name]["class"] == cls.__name__
        assert cls.__doc__ and ">>>" in cls.__doc__, f"{cls.__name__} has no runnable example"
        assert cls.full_state_update is False


def test_glossary_resolves_aliases_and_refuses_unknown_names():
    # every class's keys in the markdown, and its name, aliases and keys found: test_contracts.py's glossary case
    assert glossary.lookup("|Δlogp|").name == "|Δlogp|"
    assert glossary.lookup("opbc/kl/k3").name == "kl"
    with pytest.raises(KeyError):
        glossary.lookup("no such metric")


# -- README: the commands it gives are true ------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_install_extras_and_make_targets_exist():
    table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([A-Za-z0-9_-]+) = \[", table, re.M))
    for line in README.splitlines():
        for group in re.findall(r"\[([a-z,]+)\]", line) if "pip install" in line else []:
            assert set(group.split(",")) <= extras, line
    assert {"lightning", "wandb", "report", "dev"} <= extras
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in README and re.search(rf"^{target}:", makefile, re.M), target


def test_readme_use_snippet_runs():
    block = README.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    t = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    scope = {"loader": [{"trainer_logprobs": t, "rollout_logprobs": t - 0.1}]}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["values"]["opbc/is/ess"].item() == pytest.approx(1.0)


def test_readme_controller_snippet_runs(capsys):
    """The controller block as written, on a batch of two groups: one on-policy (train), one with a vetoed token
    (quarantine: veto, and the ESS that token takes down): the loss keeps the first group's tokens only, and each
    decision is printed."""
    block = README.split("## The Off-Policy Budget Controller", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    trainer = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rollout = trainer.clone()
    rollout[3, 2] = trainer[3, 2] - 40.0  # |r| = 40 > the veto (30)
    batch = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "group_ids": torch.tensor([0, 0, 1, 1])}
    scope = {"batch": batch, "per_token_loss": torch.ones(4, 6, dtype=torch.float64)}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["loss"].item() == pytest.approx(1.0)
    assert scope["out"].loss_mask.tolist() == [[1.0] * 6] * 2 + [[0.0] * 6] * 2
    # every reason that held: the vetoed token's weight (e^20 after the clamp) also takes the ESS below 1 / 5
    assert capsys.readouterr().out.splitlines() == ["0 train []",
                                                    "1 quarantine ['veto', 'ess_below_min', 'ess_below_replay']"]


def test_readme_cli_commands_parse():
    from opbc_metrics.cli import build_parser

    block = README.split("## Offline analysis", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    for line in block.splitlines():
        command = line.split("#", 1)[0].split("|")[-1].split()
        assert command[0] == "opbc-metrics", line
        build_parser().parse_args(command[1:])  # SystemExit on an unknown option or command
