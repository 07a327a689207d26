"""Independent references of every section's formulas, written from the design text and the sources alone.

Deliberately naive: select the valid tokens with boolean indexing, loop over sequences, tokens and groups,
Python sets, sort for the top-1% mass. Everything in float64. The mismatch reference has no token (sequence)
statistics for a window without a valid token (sequence): the metrics report no keys then. The rollout
reference's Gini comes in two independent forms: the pairwise definition ``sum_i sum_j |x_i - x_j| / (2 n^2
mean)`` and the sorted-rank form ``2 sum_i i x_(i) / (n sum x) - (n + 1) / n``; its std is the sample std
(ddof=1, as Telescope).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from opbc_metrics.functional.per_round import DEFAULT_ROUND_CAPACITY


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
        k = max(1, n // 100)  # floor(0.01 N), in integers
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
        # verl's probs_diff_std: torch.std (divisor N - 1) of |p - q|; undefined for a single token: no key.
        if n > 1:
            out["opbc/prob/diff_std"] = float(np.abs(p - q).std(ddof=1))
        if n < 2:  # a correlation needs two tokens: no key
            pass
        elif p.std() > 0 and q.std() > 0:
            out["opbc/prob/pearson"] = float(np.corrcoef(p, q)[0, 1])
        else:
            out["opbc/prob/pearson"] = 1.0 if np.all(p == q) else 0.0

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


# --- MoE router drift (loops over tokens and layers; Python sets for the top-K comparison) ---------
FLIP = "moe/router/flip_rate"
SET = "moe/router/topk_disagreement_rate"
WORST = "moe/router/worst_layer"
WORST_RATE = "moe/router/worst_layer_flip_rate"


def router_reference(rollout, trainer, mask=None, num_layers=None) -> dict[str, float]:
    """Loops over tokens and layers; Python sets for the top-K comparison. ``num_layers``: the capacity, layers
    beyond it pooled (the metric's default capacity; a configured one raises instead). Only layers that saw a
    valid token get a key."""
    rollout, trainer = np.asarray(rollout), np.asarray(trainer)
    b, t, n_layers, _ = rollout.shape
    mask = np.ones((b, t), dtype=bool) if mask is None else np.asarray(mask) != 0
    cap = n_layers if num_layers is None else num_layers
    flips, pairs = np.zeros(cap + 1), np.zeros(cap + 1)  # per layer bucket
    tokens = set_diff = 0
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            tokens += 1
            differs = False
            for layer in range(n_layers):
                bucket = min(layer, cap)
                pairs[bucket] += 1
                if rollout[i, j, layer, 0] != trainer[i, j, layer, 0]:
                    flips[bucket] += 1
                if set(rollout[i, j, layer].tolist()) != set(trainer[i, j, layer].tolist()):
                    differs = True
            set_diff += differs
    rates = [flips[k] / pairs[k] if pairs[k] else 0.0 for k in range(cap + 1)]
    out = {
        FLIP: flips.sum() / pairs.sum() if pairs.sum() else 0.0,
        SET: set_diff / tokens if tokens else 0.0,
    }
    worst, worst_rate = -1, 0.0
    for k in range(cap + 1):
        if pairs[k] and (worst < 0 or rates[k] > worst_rate):
            worst, worst_rate = k, rates[k]
    out[WORST] = float(worst)
    out[WORST_RATE] = worst_rate
    for k in range(cap):  # layers seen with a valid token: a layer without data has no rate
        if pairs[k]:
            out[f"moe/router/layer_{k}/flip_rate"] = rates[k]
    if pairs[cap]:  # something overflowed the capacity
        out["moe/router/layer_overflow/flip_rate"] = rates[cap]
    return out


# --- per-round mismatch (plain Python loops, after verl PR #5229's semantics) ---------------------
P = "per_round/"


def segments(row) -> list[tuple[int, int]]:
    """(start, end) of each run of nonzero values, end exclusive, scanning token by token."""
    out, start = [], None
    for i, value in enumerate(row):
        if value != 0 and start is None:
            start = i
        elif value == 0 and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(row)))
    return out


def per_round_reference(trainer, rollout, mask=None, capacity=DEFAULT_ROUND_CAPACITY) -> dict[str, float]:
    trainer = np.asarray(trainer, dtype=np.float64).tolist()
    rollout = np.asarray(rollout, dtype=np.float64).tolist()
    mask = [[1] * len(row) for row in trainer] if mask is None else np.asarray(mask).tolist()
    diffs: dict[int, list[float]] = {}  # bucket -> |r| of finite tokens
    counts: dict[int, int] = {}  # bucket -> response tokens
    most = 0
    for tr, ro, m in zip(trainer, rollout, mask):
        segs = segments(m)
        most = max(most, len(segs))
        for i, (start, end) in enumerate(segs):
            bucket = min(i, capacity)
            counts[bucket] = counts.get(bucket, 0) + (end - start)
            for j in range(start, end):
                if math.isfinite(tr[j]) and math.isfinite(ro[j]):
                    diffs.setdefault(bucket, []).append(abs(tr[j] - ro[j]))
    out = {P + "total_rounds": float(most)}
    means = {}
    for i in range(capacity + 1):
        values = diffs.get(i, [])
        means[i] = sum(values) / len(values) if values else 0.0
        name = f"round_{i}" if i < capacity else "overflow"
        if values:  # a round without a finite token has no mean (its token count stays)
            out[P + f"{name}_abs_diff_mean"] = means[i]
        out[P + f"{name}_token_count"] = float(counts.get(i, 0))
    best, best_value = -1, -1.0
    for i in range(capacity + 1):  # verl's strict ">" scan in round order
        if diffs.get(i) and means[i] > best_value:
            best, best_value = i, means[i]
    if best >= 0:  # no round with a finite token: no worst round (as verl)
        out[P + "max_round_diff"] = float(best)
        out[P + "max_diff_value"] = best_value
    return out


# --- agent trajectories (raw OpenAI-style message lists, never the library's data model) ----------
KINDS = ("tool_choice", "tool_arguments", "content", "length")
AGENT_KEYS = [
    "agent/trajectory/tool_call_jaccard",
    "agent/trajectory/first_divergence_step_mean",
    "agent/trajectory/first_divergence_step_min",
    "agent/trajectory/diverged_fraction",
    *(f"agent/trajectory/divergence_kind/{k}" for k in KINDS),
    "agent/trajectory/num_pairs",
    "agent/answer/match_rate",
    "agent/answer/soft_match_mean",
    "agent/steps/tool_choice_disagreement_rate",
    "agent/steps/rollout_mean",
    "agent/steps/reference_mean",
]


def ref_canon(arguments):
    """('json', canonical text) or ('raw', stripped text) for malformed JSON; None/blank mean {}."""
    if arguments is None or (isinstance(arguments, str) and arguments.strip() == ""):
        return ("json", "{}")
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return ("raw", arguments.strip())
    else:
        value = arguments
    return ("json", json.dumps(value, sort_keys=True, separators=(",", ":")))


def ref_norm(text):
    return re.sub(r"\s+", " ", text or "").strip().lower()


def ref_parse(messages):
    steps = []
    for m in messages:
        if m["role"] != "assistant":
            continue
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "".join(part["text"] for part in content)
        calls = [(tc["function"]["name"], ref_canon(tc["function"].get("arguments")))
                 for tc in m.get("tool_calls") or []]
        steps.append((content, calls))
    answer = steps[-1][0] if not steps[-1][1] else None
    return steps, answer


def ref_pair(rollout, reference):
    (sa, ans_a), (sb, ans_b) = ref_parse(rollout), ref_parse(reference)
    set_a = {c for _, calls in sa for c in calls}
    set_b = {c for _, calls in sb for c in calls}
    jac = 1.0 if not (set_a | set_b) else len(set_a & set_b) / len(set_a | set_b)
    div = None
    for i in range(min(len(sa), len(sb))):
        names_a, names_b = [c[0] for c in sa[i][1]], [c[0] for c in sb[i][1]]
        if names_a != names_b:
            div = (i, "tool_choice")
        elif [c[1] for c in sa[i][1]] != [c[1] for c in sb[i][1]]:
            div = (i, "tool_arguments")
        elif not sa[i][1] and ref_norm(sa[i][0]) != ref_norm(sb[i][0]):  # text is the action without tools
            div = (i, "content")
        if div:
            break
    if div is None and len(sa) != len(sb):
        div = (min(len(sa), len(sb)), "length")
    match = ref_norm(ans_a) != "" and ref_norm(ans_a) == ref_norm(ans_b)  # no answer on both sides: no match
    soft = ref_token_f1(ref_norm(ans_a), ref_norm(ans_b))
    disagree = either = 0
    for i in range(max(len(sa), len(sb))):
        names_a = [c[0] for c in sa[i][1]] if i < len(sa) else []
        names_b = [c[0] for c in sb[i][1]] if i < len(sb) else []
        if names_a or names_b:
            either += 1
            if names_a != names_b:
                disagree += 1
    return jac, div, match, disagree, either, soft, len(sa), len(sb)


def ref_token_f1(a, b):
    """SQuAD's token F1 of two normalised answers, counted token by token."""
    ta, tb = a.split(), b.split()
    rest, common = list(tb), 0
    for tok in ta:
        if tok in rest:
            rest.remove(tok)
            common += 1
    if common == 0:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def agent_reference(pairs):
    """Every agent key with a value: a ratio whose denominator is 0 (no pair, no diverged pair, no tool-calling
    step) has none and is left out; ``num_pairs`` is always there."""
    rows = [ref_pair(a, b) for a, b in pairs]
    n = len(rows)
    diverged = [r[1] for r in rows if r[1] is not None]
    steps = [d[0] for d in diverged]
    either = sum(r[4] for r in rows)
    out = {"agent/trajectory/num_pairs": float(n)}
    if n:
        out.update({
            "agent/trajectory/tool_call_jaccard": sum(r[0] for r in rows) / n,
            "agent/trajectory/diverged_fraction": len(diverged) / n,
            "agent/answer/match_rate": sum(r[2] for r in rows) / n,
            "agent/answer/soft_match_mean": sum(r[5] for r in rows) / n,
            "agent/steps/rollout_mean": sum(r[6] for r in rows) / n,
            "agent/steps/reference_mean": sum(r[7] for r in rows) / n,
        })
        for kind in KINDS:
            out[f"agent/trajectory/divergence_kind/{kind}"] = sum(d[1] == kind for d in diverged) / n
    if steps:
        out["agent/trajectory/first_divergence_step_mean"] = sum(steps) / len(steps)
        out["agent/trajectory/first_divergence_step_min"] = min(steps)
    if either:
        out["agent/steps/tool_choice_disagreement_rate"] = sum(r[3] for r in rows) / either
    return out


# --- endpoint capabilities -------------------------------------------------------------------------
FLAGS = (
    "token_ids_available",
    "prompt_token_ids_available",
    "sampled_logprobs_available",
    "top_logprobs_available",
    "seed_requested",
    "seed_supported",
)
ENDPOINT_KEYS = [*(f"endpoint/capabilities/{f}" for f in FLAGS), "endpoint/capabilities/num_responses"]


def ref_flags(resp, req):
    chat = resp["object"] == "chat.completion"
    per_choice = []
    for c in resp["choices"]:
        lp = c.get("logprobs")
        if chat:
            items = (lp or {}).get("content") or []
            tokens = [it["token"] for it in items]
            sampled = len(items) > 0
            top = len(items) > 0 and all(len(it.get("top_logprobs") or []) > 0 for it in items)
            prompt = bool(resp.get("prompt_token_ids"))
        else:
            tokens = lp["tokens"] if lp else []
            sampled = bool(lp) and any(v is not None for v in lp["token_logprobs"])
            # alternatives at every sampled position; a null entry only where nothing was sampled (an echoed token)
            tops, sampled_at = (lp or {}).get("top_logprobs") or [], (lp or {}).get("token_logprobs") or []
            held = [e for j, e in enumerate(tops)
                    if e is not None or (j < len(sampled_at) and sampled_at[j] is not None)]
            top = any(e is not None for e in held) and all(e is not None and len(e) > 0 for e in held)
            prompt = bool(c.get("prompt_token_ids")) or bool(resp.get("prompt_token_ids"))
        ids = bool(c.get("token_ids")) or (len(tokens) > 0 and all(re.fullmatch(r"token_id:-?\d+", t) for t in tokens))
        per_choice.append((ids, prompt, sampled, top))
    out = {name: all(row[i] for row in per_choice) for i, name in enumerate(FLAGS[:4])}
    out["seed_requested"] = req is not None and req.get("seed") is not None
    out["seed_supported"] = out["seed_requested"] and bool(resp.get("system_fingerprint"))
    return out


def endpoint_reference(exchanges):
    n = len(exchanges)
    rows = [ref_flags(resp, req) for resp, req in exchanges]
    out = {f"endpoint/capabilities/{f}": (sum(r[f] for r in rows) / n if n else 0.0) for f in FLAGS}
    out["endpoint/capabilities/num_responses"] = float(n)
    return out


# --- rollout groups --------------------------------------------------------------------------------

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
    ids = list(group_ids)
    x = np.asarray(values, dtype=np.float64)
    return [x[np.array([i == g for i in ids], dtype=bool)] for g in dict.fromkeys(ids)]


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
    first: dict = {}
    for i, g in enumerate(group_ids):
        first.setdefault(g, i)
    return list(first.values())


def per_sample(values, mask, how):
    """[B] as is; [B, T] summed (rewards) or averaged (advantages) over the mask; returns (x, keep)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        return v, np.ones(v.shape[0], dtype=bool)
    m = np.ones_like(v, dtype=bool) if mask is None else np.asarray(mask) != 0
    xs, keep = [], []
    for row, mrow in zip(v, m):
        sel = row[mrow]
        xs.append(sel.sum() if how == "sum" else (sel.mean() if sel.size else 0.0))
        keep.append(sel.size > 0)  # a sample without response tokens has no value
    return np.array(xs), np.array(keep, dtype=bool)


def rollout_reference(batch: dict, sample_names=()) -> dict[str, float]:
    """Every rollout key from one (concatenated) batch of whole groups."""
    out: dict[str, float] = {}
    mask = batch.get("response_mask")
    gid = [g.item() if hasattr(g, "item") else g for g in batch["group_ids"]] if "group_ids" in batch else None
    if "rewards" in batch:
        r, keep = per_sample(batch["rewards"], mask, "sum")
        if keep.any():  # no sample with a response token: no reward keys
            out.update({f"rollout/reward/{k}": v for k, v in describe(r[keep]).items()})
            if gid is not None:
                out["rollout/reward/group_gini_mean"] = group_gini_mean([g for g, k in zip(gid, keep) if k], r[keep])
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
        hit = [s == "length" or (not isinstance(s, str) and s is not None and int(s) == 1)
               for s in batch["stop_reasons"]]
        out["rollout/stop_reason/length_pct"] = 100.0 * sum(hit) / len(hit) if hit else 0.0
    if "discard_reasons" in batch:
        codes = [int({"max_async": 1, "zero_advantage": 2, None: 0}.get(s, s)) for s in batch["discard_reasons"]]
        n_async, n_zero = codes.count(1), codes.count(2)
        out["rollout/discarded/max_async"] = float(n_async)
        out["rollout/discarded/zero_advantage"] = float(n_zero)
        out["rollout/discarded/total"] = float(n_async + n_zero)
        out["rollout/discarded/pct"] = 100.0 * (n_async + n_zero) / len(codes) if codes else 0.0
        if n_async + n_zero:
            out["rollout/discarded/max_async_pct"] = 100.0 * n_async / (n_async + n_zero)
            out["rollout/discarded/zero_advantage_pct"] = 100.0 * n_zero / (n_async + n_zero)
        if "rewards" in batch:
            r, keep = per_sample(batch["rewards"], mask, "sum")
            zr = [float(x) for x, code, k in zip(r, codes, keep) if code == 2 and k]
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
            ginis = [gini_pairwise(g[~np.isnan(g)]) for g in groups_of(gid, col) if (~np.isnan(g)).any()]
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


def assert_rounds_close(got, want, rel=1e-12, abs_tol=1e-12):
    """Per-round keys against :func:`per_round_reference`: keys of rounds that never occurred are left out of
    ``got``; the reference reads 0 for them."""
    assert set(got) <= set(want), set(got) - set(want)
    assert all(want[key] == 0 for key in set(want) - set(got)), set(want) - set(got)
    for key, value in ((k, want[k]) for k in got):
        assert math.isclose(got[key], value, rel_tol=rel, abs_tol=abs_tol), (key, got[key], value)
