"""The four-field glossary, read from the metric classes themselves.

Each public metric class carries a :class:`~opbc_metrics.metric.GlossaryEntry`: what it is, the unit
it aggregates over, the cap that triggers an OPBC action, and what happens when the cap fires. This
module collects them, so the glossary can never drift from the code.

The contract for values (:data:`NO_DATA_CONTRACT`): a metric that saw no data in the window (no valid
token, sequence, pair or sample on any rank) reports no key, never an "on-policy" value; the input
accounting keys (``opbc/input/*``) always report, zero counts included; zero counts in a window that had
data are data.
"""

from __future__ import annotations

from typing import Any

import opbc_metrics  # noqa: F401  (imports every section, which registers its classes)
from opbc_metrics.metric import GlossaryEntry, OPBCMetric, registered_metrics

NO_DATA_CONTRACT = (
    "A metric that saw no data in the window (no valid token, sequence, pair or sample, over all ranks) "
    "reports no key: a missing key means 'not measured', never 'on-policy'. The input-accounting keys "
    "(opbc/input/nonfinite_count, num_tokens, num_sequences) always report, zero included. Zero counts in "
    "a window that had data are data (e.g. opbc/decision/reason_count/*)."
)


def public_metrics() -> list[type[OPBCMetric]]:
    """Every concrete metric class the package defines, in definition order."""
    return [cls for cls in registered_metrics() if cls.__module__.startswith("opbc_metrics")]


def glossary_dict() -> dict[str, dict[str, Any]]:
    """The glossary as ``{entry name: {class, keys, what, unit, cap, action, aliases}}``.

    Example:
        >>> entry = glossary_dict()["ESS"]
        >>> entry["keys"], entry["class"]
        (['opbc/is/ess'], 'ImportanceSamplingESS')
    """
    out: dict[str, dict[str, Any]] = {}
    for cls in public_metrics():
        entry = cls.glossary
        if entry is None:
            raise ValueError(f"{cls.__name__} has no glossary entry")
        out[entry.name] = {
            "class": cls.__name__,
            "keys": list(cls.keys),
            "what": entry.what,
            "unit": entry.unit,
            "cap": entry.cap,
            "action": entry.action,
            "aliases": list(entry.aliases),
            "higher_is_better": cls.higher_is_better,
        }
    return out


def lookup(name: str) -> GlossaryEntry:
    """The entry for a name, an alias or a key.

    Example:
        >>> lookup("opbc/is/ess").name
        'ESS'
    """
    for cls in public_metrics():
        entry = cls.glossary
        if entry is not None and (name == entry.name or name in entry.aliases or name in cls.keys):
            return entry
    raise KeyError(f"no glossary entry named {name!r}")


def glossary_markdown() -> str:
    """The glossary rendered as Markdown, one section per entry.

    Example:
        >>> print(glossary_markdown().splitlines()[0])
        # opbc-metrics glossary
    """
    lines = ["# opbc-metrics glossary", "", NO_DATA_CONTRACT, ""]
    for name, e in glossary_dict().items():
        lines += [f"## {name}", "", f"- **keys**: {', '.join(f'`{k}`' for k in e['keys'])}"]
        if e["aliases"]:
            lines.append(f"- **aliases**: {', '.join(e['aliases'])}")
        lines += [
            f"- **what it is**: {e['what']}",
            f"- **unit**: {e['unit']}",
            f"- **cap**: {e['cap']}",
            f"- **when the cap fires**: {e['action']}",
            "",
        ]
    return "\n".join(lines)
