"""An independent reference for the rollout-group metrics, written from the design text alone, and its self-checks.

Deliberately naive: Python loops over groups, boolean indexing, ``np.median``, ``np.std`` (sample,
ddof=1, as Telescope: no std for a single sample). Gini comes in two independent forms: the pairwise definition
``sum_i sum_j |x_i - x_j| / (2 n^2 mean)`` and the sorted-rank form
``2 sum_i i x_(i) / (n sum x) - (n + 1) / n``. Every value in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

STATS = ("mean", "std", "min", "max")


def gini_pairwise(values) -> float:
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    if n < 2 or x.sum() <= 0:
        return 0.0
    total = 0.0
    for a in x:
        for b in x:
            total += abs(a - b)
    return total / (2.0 * n * n * x.mean())


def gini_sorted_rank(values) -> float:
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    if n < 2 or x.sum() <= 0:
        return 0.0
    i = np.arange(1, n + 1)
    return float(2.0 * (i * x).sum() / (n * x.sum()) - (n + 1.0) / n)


def describe(values) -> dict[str, float]:
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"mean": 0.0, "min": 0.0, "max": 0.0}
    out = {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())}
    if x.size > 1:
        out["std"] = float(x.std(ddof=1))
    return out


def groups_of(group_ids, values) -> list[np.ndarray]:
    """Values per group, groups in order of first appearance (the order does not matter for means)."""
    ids = [g for g in group_ids]
    seen: dict = {}
    for g in ids:
        seen.setdefault(g, None)
    x = np.asarray(values, dtype=np.float64)
    return [x[np.array([i == g for i in ids], dtype=bool)] for g in seen]


def group_gini_mean(group_ids, values, form=gini_pairwise) -> float:
    gs = groups_of(group_ids, values)
    return float(np.mean([form(g) for g in gs])) if gs else 0.0


def group_max_median_mean(group_ids, lengths, keep=None) -> float | None:
    """Telescope: max / median per group, no floor; a group with median 0 has no ratio (left out)."""
    keep = np.ones(len(lengths), dtype=bool) if keep is None else np.asarray(keep, dtype=bool)
    ratios = []
    for g, k in zip(groups_of(group_ids, lengths), groups_of(group_ids, keep)):
        g = g[k.astype(bool)]
        if g.size and np.median(g) > 0:
            ratios.append(g.max() / np.median(g))
    return float(np.mean(ratios)) if ratios else None  # no group has a ratio: not measured


def group_cv_mean(group_ids, lengths) -> float | None:
    """Telescope: stddev_samp / avg of the lengths per group; groups of one or with mean 0 left out."""
    cvs = [float(np.std(g, ddof=1) / np.mean(g)) for g in groups_of(group_ids, lengths) if g.size > 1 and g.mean() > 0]
    return float(np.mean(cvs)) if cvs else None  # no group has a CV: not measured


def first_of_each_group(group_ids) -> list[int]:
    seen: set = set()
    out = []
    for i, g in enumerate(group_ids):
        if g not in seen:
            seen.add(g)
            out.append(i)
    return out


def per_sample(values, mask, how):
    """[B] as is; [B, T] summed (rewards) or averaged (advantages) over the mask; returns (x, keep)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        return v, np.ones(v.shape[0], dtype=bool)
    m = np.ones_like(v, dtype=bool) if mask is None else np.asarray(mask) != 0
    xs, keep = [], []
    for row, mrow in zip(v, m):
        sel = row[mrow]
        if how == "sum":
            xs.append(sel.sum())
            keep.append(True)
        else:
            xs.append(sel.mean() if sel.size else 0.0)
            keep.append(sel.size > 0)
    return np.array(xs), np.array(keep, dtype=bool)


def rollout_reference(batch: dict, sample_names=()) -> dict[str, float]:
    """Every rollout key from one (concatenated) batch of whole groups."""
    out: dict[str, float] = {}
    mask = batch.get("response_mask")
    gid = [g.item() if hasattr(g, "item") else g for g in batch["group_ids"]] if "group_ids" in batch else None
    if "rewards" in batch:
        r, _ = per_sample(batch["rewards"], mask, "sum")
        out.update({f"rollout/reward/{k}": v for k, v in describe(r).items()})
        if gid is not None:
            out["rollout/reward/group_gini_mean"] = group_gini_mean(gid, r)
    if "advantages" in batch:
        a, keep = per_sample(batch["advantages"], mask, "mean")
        out.update({f"rollout/advantage/{k}": v for k, v in describe(a[keep]).items()})
    p = np.asarray(batch["prompt_lengths"], dtype=np.float64) if "prompt_lengths" in batch else None
    c = np.asarray(batch["response_lengths"], dtype=np.float64) if "response_lengths" in batch else None
    if p is not None:
        prompts = p if gid is None else p[first_of_each_group(gid)]  # one prompt per group
        out.update({f"rollout/tokens_prompt/{k}": v for k, v in describe(prompts).items()})
    if c is not None:
        out.update({f"rollout/tokens_completion/{k}": v for k, v in describe(c).items()})
        if gid is not None:
            out["rollout/tokens_completion/group_gini_mean"] = group_gini_mean(gid, c)
            out["rollout/tokens_completion/group_max_median_ratio_mean"] = group_max_median_mean(gid, c)
            out["rollout/tokens_completion/group_cv_mean"] = group_cv_mean(gid, c)
    if p is not None and c is not None:
        out.update({f"rollout/tokens_total/{k}": v for k, v in describe(p + c).items()})
    if "stop_reasons" in batch:
        reasons = list(batch["stop_reasons"])
        hits = sum(1 for s in reasons if s == "length" or (not isinstance(s, str) and s is not None and int(s) == 1))
        out["rollout/stop_reason/length_pct"] = 100.0 * hits / len(reasons) if reasons else 0.0
    if "discard_reasons" in batch:
        codes = [{"max_async": 1, "zero_advantage": 2, None: 0}.get(s, s) for s in batch["discard_reasons"]]
        codes = [int(c) for c in codes]
        n_async, n_zero = codes.count(1), codes.count(2)
        out["rollout/discarded/max_async"] = float(n_async)
        out["rollout/discarded/zero_advantage"] = float(n_zero)
        out["rollout/discarded/total"] = float(n_async + n_zero)
        out["rollout/discarded/pct"] = 100.0 * (n_async + n_zero) / len(codes) if codes else 0.0
        if n_async + n_zero:
            out["rollout/discarded/max_async_pct"] = 100.0 * n_async / (n_async + n_zero)
            out["rollout/discarded/zero_advantage_pct"] = 100.0 * n_zero / (n_async + n_zero)
        if "rewards" in batch:
            r, _ = per_sample(batch["rewards"], mask, "sum")
            zr = [float(x) for x, code in zip(r, codes) if code == 2]
            out["rollout/discarded/zero_advantage_all_zero"] = float(sum(x == 0 for x in zr))
            out["rollout/discarded/zero_advantage_all_positive"] = float(sum(x > 0 for x in zr))
            if zr:
                out["rollout/discarded/zero_advantage_reward_mean"] = sum(zr) / len(zr)
        if c is not None:
            gone = [code in (1, 2) for code in codes]
            lengths = c[np.array(gone, dtype=bool)]
            if lengths.size:
                out.update({f"rollout/discarded/tokens_completion/{k}": v for k, v in describe(lengths).items()})
            if gid is not None:
                ginis = [gini_pairwise(g[k.astype(bool)]) for g, k in zip(groups_of(gid, c), groups_of(gid, gone))
                         if k.any()]
                if ginis:
                    out["rollout/discarded/tokens_completion/group_gini_mean"] = float(np.mean(ginis))
                ratio = group_max_median_mean(gid, c, gone)
                ratios_exist = any(np.median(g[k.astype(bool)]) > 0 for g, k in
                                   zip(groups_of(gid, c), groups_of(gid, gone)) if k.any())
                if ratios_exist:
                    out["rollout/discarded/tokens_completion/group_max_median_ratio_mean"] = ratio
            if "stop_reasons" in batch and any(gone):
                hit = [s == "length" or (not isinstance(s, str) and s is not None and int(s) == 1)
                       for s in batch["stop_reasons"]]
                out["rollout/discarded/stop_reason/length_pct"] = (
                    100.0 * sum(h and g for h, g in zip(hit, gone)) / sum(gone))
    if "policy_lag" in batch:
        out.update({f"rollout/off_policy_steps/{k}": v for k, v in describe(batch["policy_lag"]).items()})
    if sample_names:
        sm = batch["sample_metrics"]
        for name in sample_names:
            col = np.asarray(sm[name], dtype=np.float64) if name in sm else np.full(len(gid), np.nan)
            present = ~np.isnan(col)
            if not present.any():  # no sample reported this metric in the window: it has no keys
                out.update({f"sample_metrics/{name}/{k}": None for k in ("mean", "min", "max", "group_gini_mean")})
                continue
            out.update({f"sample_metrics/{name}/{k}": v for k, v in describe(col[present]).items()})
            gs = [g for g in groups_of(gid, col)]
            ginis = [gini_pairwise(g[~np.isnan(g)]) for g in gs if (~np.isnan(g)).any()]
            out[f"sample_metrics/{name}/group_gini_mean"] = float(np.mean(ginis)) if ginis else 0.0
    return out


def zero_advantage_reference(rewards, group_ids, advantages=None) -> list[bool]:
    """Telescope: groups of two or more whose rewards are all equal, or, with advantages, whose advantages
    are all within 1e-9 of the group's first one."""
    r = np.asarray(rewards, dtype=np.float64)
    out = []
    for g in group_ids:
        members = [i for i, h in enumerate(group_ids) if h == g]
        if len(members) < 2:
            out.append(False)
        elif advantages is not None:
            a0 = float(advantages[members[0]])
            out.append(all(abs(float(advantages[i]) - a0) < 1e-9 for i in members))
        else:
            out.append(len({float(r[i]) for i in members}) == 1)
    return out


# --- self-checks of the reference -------------------------------------------------------------------
@pytest.mark.parametrize(
    "values,expected",
    [([1, 1, 1], 0.0), ([0, 0, 0, 1], 0.75), ([1, 2, 3, 4], 0.25), ([5], 0.0), ([0, 0], 0.0), ([-1, 1], 0.0),
     ([1, 3], 0.25)],
)
def test_reference_gini_known_values(values, expected):
    assert gini_pairwise(values) == pytest.approx(expected, abs=1e-15)
    assert gini_sorted_rank(values) == pytest.approx(expected, abs=1e-15)


def test_reference_gini_forms_agree():
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.exponential(size=rng.integers(1, 12)) * rng.integers(0, 2, 1)
        assert math.isclose(gini_pairwise(x), gini_sorted_rank(x), rel_tol=1e-12, abs_tol=1e-14)
