"""Independent references for the training metrics, written from the glossary / verl semantics alone.

Plain Python and NumPy, deliberately naive: boolean indexing, loops over sequences and pairs, exact
binomials (``math.comb``), enumeration of subsets. Equivalent reformulations are used where they make the
check independent (e.g. the clip fractions via ``A > 0 and rho > 1 + eps``). ``tests/test_reference.py``
checks the references themselves against brute force.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np


# --- generic -------------------------------------------------------------------------------------------------
def _valid(mask, shape):
    return np.ones(shape, dtype=bool) if mask is None else np.asarray(mask) != 0


def ref_token_entropies(logits, temperature=1.0):
    """[B, T] entropies of softmax(logits / temperature), one position at a time."""
    lg = np.asarray(logits, dtype=np.float64) / temperature
    hs = np.zeros(lg.shape[:2])
    for b, t in np.ndindex(*hs.shape):
        e = np.exp(lg[b, t] - lg[b, t].max())
        p = e[e > 0] / e.sum()
        hs[b, t] = -(p * np.log(p)).sum()
    return hs


def ref_entropy(entropies=None, mask=None, logits=None, temperature=1.0):
    h = ref_token_entropies(logits, temperature) if logits is not None else np.asarray(entropies, np.float64)
    sel = h[_valid(mask, h.shape)]
    return float(sel.mean()) if sel.size else 0.0


def ref_kl(new, old, mask=None, estimator="k1", clamp=20.0):
    new, old = np.asarray(new, np.float64), np.asarray(old, np.float64)
    vals = []
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if mask is not None and not mask[b][t]:
                continue
            r = min(max(new[b, t] - old[b, t], -clamp), clamp)
            vals.append({"k1": -r, "k2": r * r / 2, "k3": math.exp(r) - 1 - r}[estimator])
    return sum(vals) / len(vals) if vals else 0.0


def ref_clipfrac(new, old, adv, mask=None, eps_low=0.2, eps_high=0.2, c=3.0, clamp=20.0):
    """clip active <=> A (rho - clip(rho)) > 0; dual clip <=> A < 0 and max(rho, clip(rho)) > c."""
    new, old = np.asarray(new, np.float64), np.asarray(old, np.float64)
    adv = np.asarray(adv, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], new.shape[1], axis=1)
    n = clipped = lower = 0
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if mask is not None and not mask[b][t]:
                continue
            rho = math.exp(min(max(new[b, t] - old[b, t], -clamp), clamp))
            a = adv[b, t]
            n += 1
            clipped += (a > 0 and rho > 1 + eps_high) or (a < 0 and rho < 1 - eps_low)
            lower += a < 0 and max(rho, min(max(rho, 1 - eps_low), 1 + eps_high)) > c
    return (clipped / n, lower / n) if n else (0.0, 0.0)


def _token_select(x, mask):
    x = np.asarray(x, np.float64)
    if x.ndim == 1 and mask is not None:
        x = np.repeat(x[:, None], np.asarray(mask).shape[1], axis=1)
    return x[_valid(mask, x.shape)] if (mask is not None or x.ndim == 2) else x


def ref_stats(x, with_std=False):
    x = np.asarray(x, np.float64)
    out = {"mean": x.mean(), "max": x.max(), "min": x.min(), "std": x.std()} if x.size else dict.fromkeys(
        ("mean", "max", "min", "std"), 0.0)
    return {k: float(v) for k, v in out.items() if with_std or k != "std"}


def ref_token_stats(x, mask=None, with_std=False):
    return ref_stats(_token_select(x, mask), with_std)


def ref_sequence_stats(x, mask=None):
    x = np.asarray(x, np.float64)
    seq = x.sum(axis=1) if x.ndim == 2 else x
    if mask is not None:
        seq = seq[np.asarray(mask).sum(axis=1) > 0]
    return ref_stats(seq)


def ref_explained_var(values, returns, mask=None):
    """verl's compute_data_metrics: 1 - Var(R - V) / (Var(R) + 1e-5), sample variances (one token: Var = 0)."""
    r, v = _token_select(returns, mask), _token_select(values, mask)
    if not r.size:
        return 0.0
    ddof = 1 if r.size > 1 else 0
    var_r, var_d = r.var(ddof=ddof), (r - v).var(ddof=ddof)
    return float(1 - var_d / (var_r + 1e-5))


def ref_lengths(lengths, max_length=None):
    x = np.asarray(lengths, np.float64)
    out = ref_stats(x)
    if max_length is not None:
        out["clip_ratio"] = float((x >= max_length).mean()) if x.size else 0.0
    return out


def ref_dpo(pc, pr, rc, rr, beta, label_smoothing=0.0):
    loss = chosen = rejected = correct = 0.0
    n = len(pc)
    for i in range(n):
        c = beta * (pc[i] - rc[i])
        r = beta * (pr[i] - rr[i])
        h = c - r
        # -log sigmoid(h) = log(1 + e^-h)
        loss += (1 - label_smoothing) * np.logaddexp(0.0, -h) + label_smoothing * np.logaddexp(0.0, h)
        chosen += c
        rejected += r
        correct += c > r
    if not n:
        return dict.fromkeys(("loss", "chosen", "rejected", "margins", "accuracy"), 0.0)
    return {"loss": loss / n, "chosen": chosen / n, "rejected": rejected / n,
            "margins": (chosen - rejected) / n, "accuracy": correct / n}


def ref_rm(chosen, rejected):
    n = len(chosen)
    if not n:
        return {"loss": 0.0, "accuracy": 0.0, "reward_margin": 0.0}
    m = [float(c) - float(r) for c, r in zip(chosen, rejected)]
    return {"loss": sum(np.logaddexp(0.0, -x) for x in m) / n, "accuracy": sum(x > 0 for x in m) / n,
            "reward_margin": sum(m) / n}


# --- validation ----------------------------------------------------------------------------------------------
def ref_pass_at_k(n, c, k):
    """Exact, with big integers: 1 - C(n-c, k) / C(n, k)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def ref_best_at_k(values, k):
    """E[max of k of the values drawn without replacement], by the rank-weight formula with exact binomials."""
    v = sorted(values, reverse=True)
    n = len(v)
    total = Fraction(0)
    for j in range(1, n + 1):
        total += Fraction(math.comb(n - j, k - 1), math.comb(n, k)) * Fraction(v[j - 1])
    return float(total)


def brute_best_at_k(values, k):
    subsets = list(itertools.combinations(values, k))
    return sum(max(s) for s in subsets) / len(subsets)


def ref_validation(rows, sources, n_samples, ks, kind):
    """rows: list of (source, samples list, valid list). Returns the per-source dict of key -> value."""
    out = {}
    for s in sources:
        mine = [(x, v) for src, x, v in rows if src == s]
        means, at_k = [], {k: [] for k in ks}
        for x, v in mine:
            vals = [xi for xi, vi in zip(x, v) if vi]
            if not vals:
                continue
            means.append(sum(vals) / len(vals))
            for k in ks:
                if len(vals) < k:
                    continue
                if kind == "acc":
                    at_k[k].append(ref_pass_at_k(len(vals), sum(xi >= 0.5 for xi in vals), k))
                else:
                    at_k[k].append(ref_best_at_k(vals, k))
        avg = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731  (no prompt: no key)
        mean_key, at_key = ((f"val-core/{s}/acc/mean@", f"val-aux/{s}/acc/pass@") if kind == "acc" else
                            (f"val-aux/{s}/reward/mean@", f"val-aux/{s}/reward/best@"))
        out[f"{mean_key}{n_samples}"] = avg(means)
        out.update({f"{at_key}{k}": avg(at_k[k]) for k in ks})
    return out


# --- load balance, timing, FLOPs -----------------------------------------------------------------------------
def ref_karmarkar_karp_sums(lengths, k, equal_size=True):
    """Largest differencing, list based: each round sorts the partial solutions by (-spread, age) and merges
    the first two, largest set of the first with the smallest of the second. Returns sorted set sums."""
    items = sorted(float(x) for x in lengths)
    if equal_size:
        items = [0.0] * ((-len(items)) % k) + items
        groups = [items[i:i + k] for i in range(0, len(items), k)]
    else:
        groups = [[x] + [0.0] * (k - 1) for x in items]
    sols = []  # (age, sums in decreasing order)
    age = 0
    for g in groups:
        sols.append((age, sorted(g, reverse=True)))
        age += 1
    while len(sols) > 1:
        sols.sort(key=lambda s: (-(s[1][0] - s[1][-1]), s[0]))
        (_, a), (_, b) = sols[0], sols[1]
        merged = sorted((a[j] + b[k - 1 - j] for j in range(k)), reverse=True)
        sols = [*sols[2:], (age, merged)]
        age += 1
    return sorted(sols[0][1]) if sols else [0.0] * k


def ref_lpt_sums(lengths, k, equal_size=True):
    """Longest processing time first, list based: items by decreasing length (ties: lower index first), each to
    the set of least load among those not yet full (ties: the lower set), full at ceil(n / k) items with
    ``equal_size``. Returns sorted set sums."""
    cap = -(-len(lengths) // k) if equal_size else len(lengths)
    sums, counts = [0.0] * k, [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-float(lengths[i]), i)):
        j = min((j for j in range(k) if counts[j] < cap), key=lambda j: (sums[j], j))
        sums[j] += float(lengths[i])
        counts[j] += 1
    return sorted(sums)


def brute_min_max_partition(lengths, k, equal_size=True):
    """Optimal largest set sum over all assignments (tiny inputs only)."""
    n = len(lengths)
    best = math.inf
    for assign in itertools.product(range(k), repeat=n):
        if equal_size and any(assign.count(j) > math.ceil(n / k) for j in range(k)):
            continue
        sums = [0.0] * k
        for i, j in enumerate(assign):
            sums[j] += lengths[i]
        best = min(best, max(sums))
    return best


def ref_transformer_active_params(hidden, layers, heads, vocab, inter, kv_heads=None, head_dim=None,
                                  experts=0, topk=0, moe_inter=None, shared=0, count_embedding=False):
    head_dim = head_dim or hidden // heads
    kv_heads = kv_heads or heads
    q_proj = hidden * heads * head_dim
    k_proj = v_proj = hidden * kv_heads * head_dim
    o_proj = heads * head_dim * hidden
    if experts:
        per_expert = 3 * hidden * (moe_inter or inter)  # gate, up, down
        mlp = per_expert * (topk + shared) + hidden * experts
    else:
        mlp = 3 * hidden * inter
    embed = vocab * hidden if count_embedding else 0
    return layers * (q_proj + k_proj + v_proj + o_proj + mlp) + vocab * hidden + embed


# --- whole sections, on one (concatenated) batch: the case table's references (tests/harness.py) ------------
SCALAR_KEYS = {"actor_loss": "actor/loss", "pg_loss": "actor/pg_loss", "entropy_loss": "actor/entropy_loss",
               "kl_loss": "actor/kl_loss", "kl_coef": "actor/kl_coef", "actor_grad_norm": "actor/grad_norm",
               "actor_lr": "actor/lr", "critic_loss": "critic/loss", "critic_lr": "critic/lr",
               "rm_grad_norm": "rm/grad_norm"}
TOKEN_WEIGHTED = {"actor_loss", "pg_loss", "entropy_loss", "kl_loss", "critic_loss"}


def ref_slowest(samples):
    """Plain Python: the first sample (generate s, tool s, prompt, response) with the largest generation + tool
    time; zeros when empty."""
    best = None
    for s in samples:
        if best is None or s[0] + s[1] > best[0] + best[1]:
            best = s
    return [float(v) for v in best] if best else [0.0, 0.0, 0.0, 0.0]


def _prefixed(prefix, stats):
    return {f"{prefix}/{k}": v for k, v in stats.items()}


def training_reference(b, clip=(0.1, 0.3), max_response=5, max_prompt=20):
    """Every key of the batch-tensor training metrics of the harness (their settings as arguments)."""
    n = {k: np.asarray(v, np.float64) for k, v in b.items() if not isinstance(v, list)}
    mask = n["response_mask"]
    new, old, lengths = n["policy_logprobs"], n["old_logprobs"], n["response_lengths"]
    clipfrac = ref_clipfrac(new, old, n["advantages"], mask, *clip)
    out = {"actor/ppo_kl": ref_kl(new, old, mask, "k1"), "actor/approx_kl": ref_kl(new, old, mask, "k2"),
           "actor/pg_clipfrac": clipfrac[0], "actor/pg_clipfrac_lower": clipfrac[1],
           "actor/entropy": ref_entropy(mask=mask, logits=n["logits"]),
           "critic/vf_explained_var": ref_explained_var(n["values"], n["returns"], mask),
           "response/aborted_ratio": float((lengths == 0).mean())}
    for prefix, field, std in (("value", "values", False), ("returns", "returns", False),
                               ("advantages", "advantages", True)):
        out.update(_prefixed(f"critic/{prefix}", ref_token_stats(n[field], mask, with_std=std)))
    for prefix, field in (("rewards", "rewards"), ("score", "scores")):
        out.update(_prefixed(f"critic/{prefix}", ref_sequence_stats(n[field], mask)))
    out.update(_prefixed("response_length", ref_lengths(lengths, max_response)))
    out.update(_prefixed("prompt_length", ref_lengths(n["prompt_lengths"], max_prompt)))
    out.update(_prefixed("num_turns", ref_stats(n["num_turns"])))
    dpo = ref_dpo(*(n[f"{w}_{s}_logps"] for w in ("policy", "reference") for s in ("chosen", "rejected")), beta=0.1)
    out.update({"loss/dpo": dpo["loss"], **{f"rewards/{k}": dpo[k] for k in ("chosen", "rejected", "margins",
                                                                               "accuracy")}})
    out.update(_prefixed("rm", ref_rm(n["chosen_scores"], n["rejected_scores"])))
    for part, field in (("generate_sequences", "agent_generate_s"), ("tool_calls", "agent_tool_calls_s")):
        out.update(_prefixed(f"timing_s/agent_loop/{part}", ref_lengths(n[field])))
    fields = ("agent_generate_s", "agent_tool_calls_s", "prompt_lengths", "response_lengths")
    slowest = ref_slowest(list(zip(*(n[f].tolist() for f in fields))))
    for part, v in zip(("generate_sequences", "tool_calls", "prompt_length", "response_length"), slowest):
        out[f"timing_s/agent_loop/slowest/{part}"] = v
    return out


def scalars_reference(b):
    """Trainer scalars: token-weighted means for the losses, plain means for the rest; LR scheduler means."""
    out = {}
    for name, key in SCALAR_KEYS.items():
        xs = b[name]
        ws = b["loss_tokens"] if name in TOKEN_WEIGHTED else [1.0] * len(xs)
        out[key] = sum(x * w for x, w in zip(xs, ws)) / sum(ws) if sum(ws) else None
    lrs = b["lr_scheduler"]["last_lr"]
    out["lr_scheduler/last_lr"] = sum(lrs) / len(lrs) if lrs else None
    return out


def validation_reference(b, sources, n_samples, ks):
    """Validation accuracy and reward per source (rows of (source, samples, valid)), and the turn counts."""
    rows = {f: [(s, b[f][p].tolist(), b["val_mask"][p].tolist()) for p, s in enumerate(b["data_sources"])]
            for f in ("val_acc", "val_rewards")}
    out = {**ref_validation(rows["val_acc"], sources, n_samples, ks, "acc"),
           **ref_validation(rows["val_rewards"], sources, n_samples, ks, "reward")}
    turns = np.asarray(b["val_num_turns"], np.float64)[np.asarray(b["val_mask"], bool)]
    out.update(_prefixed("val-aux/num_turns", ref_stats(turns)))
    return out


def steps_reference(ranks, stages, flops, peak):
    """Per-step metrics after a sync over ``len(ranks)`` ranks, from each rank's steps (a step: ``timing_s``,
    ``prompt_lengths``, ``response_lengths``): each stage's time is the slowest rank's mean over the steps that
    timed it (a stage no step timed has no key), token counts are all ranks' per step (steps: the most any rank
    ran), workloads are per rank."""
    world = len(ranks)
    n_steps = max(len(steps) for steps in ranks)
    seconds = {}
    for s in stages:
        timed = [[st["timing_s"][s] for st in steps if s in st["timing_s"]] for steps in ranks]
        if any(timed):
            seconds[s] = max(sum(t) / len(t) for t in timed if t)
    seqs = [(int(p), int(r)) for steps in ranks for st in steps
            for p, r in zip(st["prompt_lengths"].tolist(), st["response_lengths"].tolist())]
    tokens = sum(p + r for p, r in seqs) / n_steps
    response = sum(r for _, r in seqs) / n_steps
    sum_sq = sum((p + r) ** 2 for p, r in seqs) / n_steps
    out = {f"timing_s/{s}": v for s, v in seconds.items()}
    out["timing_per_token_ms/gen"] = 1000 * seconds["gen"] / response
    out["timing_per_token_ms/update_actor"] = 1000 * seconds["update_actor"] / tokens
    out.update({"perf/total_num_tokens": tokens, "perf/time_per_step": seconds["step"],
                "perf/throughput": tokens / (seconds["step"] * world)})
    active, layers, dim = flops
    forward = 2 * active * tokens + 4 * dim * layers * sum_sq
    out["perf/mfu/actor"] = 3 * forward / (seconds["update_actor"] * world * peak)
    out["perf/mfu/actor_infer"] = forward / (seconds["old_log_prob"] * world * peak)
    loads = [sum(int(p.sum() + r.sum()) for p, r in ((st["prompt_lengths"], st["response_lengths"]) for st in steps))
             for steps in ranks]
    balanced = ref_karmarkar_karp_sums([p + r for p, r in seqs], world)
    out.update({"global_seqlen/min": min(loads), "global_seqlen/max": max(loads),
                "global_seqlen/minmax_diff": max(loads) - min(loads), "global_seqlen/mean": sum(loads) / world,
                "global_seqlen/balanced_min": balanced[0], "global_seqlen/balanced_max": balanced[-1]})
    return out
