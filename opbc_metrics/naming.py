"""``section/group/metric`` keys.

Every value this library logs is keyed ``section/group/metric``. W&B builds its panel sections from
the part before the first ``/``, so each section becomes a dashboard without configuration.
"""

from __future__ import annotations

from typing import NamedTuple

GENERAL_SECTION = "General"


class MetricKey(NamedTuple):
    """A parsed key: ``section``, ``group`` (may be empty) and ``metric``."""

    section: str
    group: str
    metric: str


def parse_key(key: str) -> MetricKey:
    """Split a key by the naming rule.

    Three or more parts give section, group and the rest of the path as metric; two parts give
    section and metric with an empty group; one part goes to the ``General`` section.

    Example:
        >>> parse_key("opbc/is/ess")
        MetricKey(section='opbc', group='is', metric='ess')
        >>> parse_key("timing/forward/total/p50")
        MetricKey(section='timing', group='forward', metric='total/p50')
        >>> parse_key("loss/policy")
        MetricKey(section='loss', group='', metric='policy')
        >>> parse_key("entropy")
        MetricKey(section='General', group='', metric='entropy')
    """
    if not isinstance(key, str) or not key or any(not part for part in key.split("/")):
        raise ValueError(f"metric key must be a non-empty '/'-separated string without empty parts, got {key!r}")
    parts = key.split("/")
    if len(parts) == 1:
        return MetricKey(GENERAL_SECTION, "", parts[0])
    if len(parts) == 2:
        return MetricKey(parts[0], "", parts[1])
    return MetricKey(parts[0], parts[1], "/".join(parts[2:]))


def make_key(section: str, group: str, metric: str) -> str:
    """Join parts into a key; an empty group gives ``section/metric``.

    Example:
        >>> make_key("opbc", "is", "ess")
        'opbc/is/ess'
        >>> make_key("loss", "", "policy")
        'loss/policy'
    """
    parts = [section, group, metric] if group else [section, metric]
    key = "/".join(parts)
    parse_key(key)
    return key


def section_of(key: str) -> str:
    """The W&B panel section of a key: the text before the first ``/``.

    Example:
        >>> section_of("opbc/is/ess"), section_of("entropy")
        ('opbc', 'General')
    """
    return parse_key(key).section
