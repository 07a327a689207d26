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

import re
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
    """The entry for a name, an alias or a key, including keys that depend on a metric's settings: a key
    matching a class's pattern (``timing_s/<stage>``) or differing from one of its keys only in a numbered
    part (``per_round/round_30_abs_diff_mean``, ``moe/router/layer_60/flip_rate``).

    Example:
        >>> lookup("opbc/is/ess").name, lookup("timing_s/update_actor").name
        ('ESS', 'timing_s')
        >>> [lookup(k).name for k in ("per_round/round_30_token_count", "moe/router/layer_60/flip_rate",
        ...                           "val-core/gsm8k/acc/mean@4")]
        ['per_round_abs_diff', 'router_flip_rate', 'val-core/acc']
    """
    metrics = [cls for cls in public_metrics() if cls.glossary is not None]
    for cls in metrics:
        entry = cls.glossary
        if name == entry.name or name in entry.aliases or name in cls.keys:
            return entry
    numbered = _numbered(name)
    for cls in metrics:
        if any(_key_pattern(k).fullmatch(name) or _numbered(k) == numbered for k in cls.keys):
            return cls.glossary
    raise KeyError(f"no glossary entry named {name!r}")


def _key_pattern(key: str) -> re.Pattern[str]:
    """``sample_metrics/<name>/mean`` -> a regex where each ``<...>`` placeholder is one path segment's text."""
    return re.compile("[^/]+".join(map(re.escape, re.split(r"<[^<>/]+>", key))))


def _numbered(key: str) -> str:
    """The key with each ``_<digits>`` part (round and layer numbers) made generic."""
    return re.sub(r"_\d+(?=/|_|$)", "_#", key)


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
