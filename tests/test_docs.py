"""Doctests of every public module, and the four-field glossary read from the classes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

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


def _all_metric_classes() -> list[type]:
    for name in _modules():
        importlib.import_module(name)
    seen, todo = [], [OPBCMetric]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return [c for c in seen if c.keys and c.__module__.startswith("opbc_metrics") and not c.__name__.startswith("_")]


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


def test_glossary_renders_every_key_and_resolves_aliases():
    md = glossary.glossary_markdown()
    for cls in _all_metric_classes():
        for key in cls.keys:
            assert f"`{key}`" in md
    assert glossary.lookup("|Δlogp|").name == "|Δlogp|"
    assert glossary.lookup("opbc/kl/k3").name == "kl"
    with pytest.raises(KeyError):
        glossary.lookup("no such metric")
