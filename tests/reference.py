"""Independent NumPy reference of DESIGN's formulas, written from the design text alone.

Deliberately naive: select the valid tokens with boolean indexing, loop over sequences, sort for the
top-1% mass. Everything in float64. Empty windows return the documented on-policy values.
"""

from __future__ import annotations

import math

import numpy as np


def mismatch_reference(trainer, rollout, mask=None, clamp=20.0, veto=30.0) -> dict[str, float]:
    trainer = np.asarray(trainer, dtype=np.float64)
    rollout = np.asarray(rollout, dtype=np.float64)
    mask = np.ones_like(trainer, dtype=bool) if mask is None else np.asarray(mask) != 0
    finite = np.isfinite(trainer) & np.isfinite(rollout)
    valid = mask & finite

    r = (trainer - rollout)[valid]
    n = r.size
    out: dict[str, float] = {}
    if n:
        w = np.exp(np.clip(r, -clamp, clamp))
        rc = np.clip(r, -clamp, clamp)
        out["opbc/is/ess"] = min(1.0, w.sum() ** 2 / (n * (w**2).sum()))
        out["opbc/is/second_moment"] = (w**2).mean()
        out["opbc/is/weight_mean"] = w.mean()
        out["opbc/is/weight_std"] = w.std()  # population (divisor N)
        k = max(1, math.floor(0.01 * n))
        out["opbc/is/top_1pct_gradient_mass"] = np.sort(w)[::-1][:k].sum() / w.sum()
        out["opbc/is/clipped_fraction"] = float(np.mean(np.abs(r) > clamp))
        out["opbc/is/veto_fraction"] = float(np.mean(np.abs(r) > veto))
        out["opbc/logprob/abs_diff_mean"] = np.abs(r).mean()
        out["opbc/logprob/abs_diff_max"] = np.abs(r).max()
        out["opbc/logprob/diff_mean"] = r.mean()
        out["opbc/log_ratio/min"] = r.min()
        out["opbc/log_ratio/max"] = r.max()
        out["opbc/log_ratio/max_abs"] = np.abs(r).max()
        out["opbc/kl/k1"] = np.mean(-rc)
        out["opbc/kl/k2"] = np.mean(rc**2 / 2)
        out["opbc/kl/k3"] = np.mean(np.exp(rc) - 1 - rc)
        out["opbc/kl/chi2_token"] = np.mean(w**2) - 1
        p = np.exp(np.minimum(trainer[valid], 0.0))  # documented: logprobs > 0 read as 0
        q = np.exp(np.minimum(rollout[valid], 0.0))
        out["opbc/prob/abs_diff_mean"] = np.abs(p - q).mean()
        out["opbc/prob/abs_diff_max"] = np.abs(p - q).max()
        # verl's probs_diff_std: torch.std (divisor N - 1) of |p - q|; 0 for a single token.
        out["opbc/prob/diff_std"] = float(np.abs(p - q).std(ddof=1)) if n > 1 else 0.0
        if p.std() > 0 and q.std() > 0:
            out["opbc/prob/pearson"] = float(np.corrcoef(p, q)[0, 1])
        else:
            out["opbc/prob/pearson"] = 1.0 if np.all(p == q) else 0.0
    else:
        out.update({
            "opbc/is/ess": 1.0, "opbc/is/second_moment": 1.0, "opbc/is/weight_mean": 1.0, "opbc/is/weight_std": 0.0,
            "opbc/is/top_1pct_gradient_mass": 0.0, "opbc/is/clipped_fraction": 0.0,
            "opbc/is/veto_fraction": 0.0, "opbc/logprob/abs_diff_mean": 0.0,
            "opbc/logprob/abs_diff_max": 0.0, "opbc/logprob/diff_mean": 0.0,
            "opbc/log_ratio/min": 0.0, "opbc/log_ratio/max": 0.0, "opbc/log_ratio/max_abs": 0.0,
            "opbc/kl/k1": 0.0, "opbc/kl/k2": 0.0, "opbc/kl/k3": 0.0, "opbc/kl/chi2_token": 0.0,
            "opbc/prob/abs_diff_mean": 0.0, "opbc/prob/abs_diff_max": 0.0, "opbc/prob/pearson": 1.0,
            "opbc/prob/diff_std": 0.0,
        })

    # Sequences: at least one valid token and no non-finite response token.
    s_list, n_list = [], []
    for i in range(trainer.shape[0]):
        row_mask = mask[i]
        if not np.all(finite[i][row_mask]) or row_mask.sum() == 0:
            continue
        ri = trainer[i][row_mask] - rollout[i][row_mask]
        s_list.append(ri.sum())
        n_list.append(ri.size)
    s = np.array(s_list)
    ns = np.array(n_list, dtype=np.float64)
    m = s.size
    if m:
        ws = np.exp(np.clip(s, -clamp, clamp))
        d = -s / ns
        out["opbc/is/seq_ess"] = min(1.0, ws.sum() ** 2 / (m * (ws**2).sum()))
        out["opbc/sequence/log_ratio_mean"] = s.mean()
        out["opbc/sequence/log_ratio_abs_mean"] = np.abs(s).mean()
        out["opbc/sequence/log_ratio_max_abs"] = np.abs(s).max()
        out["opbc/sequence/geo_log_ratio_mean"] = (s / ns).mean()
        out["opbc/kl/chi2_seq"] = np.mean(ws**2) - 1
        out["opbc/ppl/log_ppl_diff"] = d.mean()
        out["opbc/ppl/log_ppl_abs_diff"] = np.abs(d).mean()
        out["opbc/ppl/ratio"] = np.exp(d).mean()
    else:
        out.update({
            "opbc/is/seq_ess": 1.0, "opbc/sequence/log_ratio_mean": 0.0,
            "opbc/sequence/log_ratio_abs_mean": 0.0, "opbc/sequence/log_ratio_max_abs": 0.0,
            "opbc/sequence/geo_log_ratio_mean": 0.0, "opbc/kl/chi2_seq": 0.0,
            "opbc/ppl/log_ppl_diff": 0.0, "opbc/ppl/log_ppl_abs_diff": 0.0, "opbc/ppl/ratio": 1.0,
        })
    out["opbc/input/nonfinite_count"] = float((mask & ~finite).sum())
    out["opbc/input/num_tokens"] = float(n)
    out["opbc/input/num_sequences"] = float(m)
    return {k: float(v) for k, v in out.items()}


DESIGN_KEYS = (
    "opbc/is/ess", "opbc/is/seq_ess", "opbc/is/second_moment", "opbc/is/weight_mean",
    "opbc/is/top_1pct_gradient_mass", "opbc/is/clipped_fraction", "opbc/is/veto_fraction",
    "opbc/logprob/abs_diff_mean", "opbc/logprob/abs_diff_max", "opbc/logprob/diff_mean",
    "opbc/log_ratio/min", "opbc/log_ratio/max", "opbc/log_ratio/max_abs",
    "opbc/sequence/log_ratio_mean", "opbc/sequence/log_ratio_abs_mean",
    "opbc/sequence/log_ratio_max_abs", "opbc/sequence/geo_log_ratio_mean",
    "opbc/kl/k1", "opbc/kl/k2", "opbc/kl/k3", "opbc/kl/chi2_token", "opbc/kl/chi2_seq",
    "opbc/ppl/log_ppl_diff", "opbc/ppl/log_ppl_abs_diff", "opbc/ppl/ratio",
    "opbc/prob/abs_diff_mean", "opbc/prob/abs_diff_max", "opbc/prob/pearson",
)
