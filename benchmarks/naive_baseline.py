"""The naive baseline for every key of the default ``OPBCCollection()``: how peers compute these numbers.

Each metric is its own pass over the raw inputs with ``.item()`` per value (the style of verl's
``calculate_debug_metrics`` and of most trainers' metric code); the per-round part is written as verl
PR #5229 describes its code: ``_find_contiguous_segments`` walks each sequence's ``response_mask`` in
Python, ``_calculate_per_round_metrics`` loops over the sequences and their rounds, concatenates each
round's tokens over the batch and averages them. The agent and endpoint parts loop over the pairs and
responses once per metric. Used by the ``naive`` section of ``bench.py``; the values agree with the
collection's (the top-1% mass here is the exact sort, the collection's the histogram sketch).

``step_batch`` makes one batch that every default section reads: multi-turn logprobs, MoE expert ids,
agent trajectory pairs and endpoint responses.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict

import torch
from torch import Tensor

from opbc_metrics.agent import Step, Trajectory
from opbc_metrics.batch import DEFAULT_CLAMP, DEFAULT_VETO


# -- the batch ------------------------------------------------------------------------------------------
def step_batch(b: int, t: int, seed: int = 0, layers: int = 4, top_k: int = 2, experts: int = 8) -> dict:
    """A multi-turn batch for every default section: 1-6 rounds a sequence separated by environment tokens
    (mask 0), padding after; expert ids ``[B, T, layers, top_k]``; ``b`` trajectory pairs and responses."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    mask = torch.zeros(b, t, dtype=torch.bool)
    rounds = torch.randint(1, 7, (b,), generator=g).tolist()
    for i, n in enumerate(rounds):
        span = t // n
        for j in range(n):  # a round, then environment tokens up to the next one
            start = j * span
            length = int(torch.randint(span // 2, span - span // 8 + 1, (1,), generator=g))
            mask[i, start : start + length] = True
    rollout_experts = torch.argsort(torch.rand(b, t, layers, experts, generator=g), dim=-1)[..., :top_k].contiguous()
    trainer_experts = rollout_experts.clone()
    swap = torch.rand(b, t, layers, generator=g) < 0.1
    trainer_experts[..., 0] = torch.where(swap, rollout_experts[..., 1], rollout_experts[..., 0])
    trainer_experts[..., 1] = torch.where(swap, rollout_experts[..., 0], rollout_experts[..., 1])
    pairs = []
    for i in range(b):
        steps = [Step(f"look {i}", [("search", {"q": f"task {i}", "k": 3})]), Step("", [("open", {"url": i % 5})])]
        other = list(steps)
        if i % 3 == 1:
            other[1] = Step("", [("open", {"url": i % 5 + 1})])
        elif i % 3 == 2:
            other = other[:1]
        answer, reference = f"Answer {i}", f"Answer {i}" if i % 4 else "other"
        pairs.append((Trajectory([*steps, Step(answer)], final_answer=answer),
                      Trajectory([*other, Step(reference)], final_answer=reference)))
    responses = []
    for i in range(b):
        content = [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}] if i % 2 else []}]
        choice = {"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": {"content": content}}
        if i % 3 == 0:
            choice["token_ids"] = [7]
        responses.append({"object": "chat.completion", "system_fingerprint": "fp" if i % 2 else None,
                          "choices": [choice]})
    requests = [{"seed": 1} if i % 4 else None for i in range(b)]
    return {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask,
            "rollout_experts": rollout_experts, "trainer_experts": trainer_experts,
            "trajectory_pairs": pairs, "endpoint_responses": responses, "endpoint_requests": requests}


# -- mismatch ---------------------------------------------------------------------------------------------
def naive_mismatch(t: Tensor, r: Tensor, m: Tensor, c: float = DEFAULT_CLAMP) -> dict[str, float]:
    """Each key its own pass from the raw tensors, ``.item()`` each (selection by boolean indexing)."""
    out: dict[str, float] = {}
    valid = lambda: m.bool() & torch.isfinite(t) & torch.isfinite(r)  # noqa: E731

    def lr() -> Tensor:
        return (t - r)[valid()]

    w = lambda: torch.exp(lr().clamp(-c, c))  # noqa: E731
    out["opbc/is/ess"] = (w().sum() ** 2 / (w().numel() * (w() ** 2).sum())).item()
    out["opbc/is/second_moment"] = (w() ** 2).mean().item()
    out["opbc/is/weight_mean"] = w().mean().item()
    out["opbc/is/weight_std"] = w().std(correction=0).item()
    ws = w()
    k = max(1, int(0.01 * ws.numel()))
    out["opbc/is/top_1pct_gradient_mass"] = (torch.topk(ws, k).values.sum() / ws.sum()).item()
    out["opbc/is/clipped_fraction"] = (lr().abs() > c).float().mean().item()
    out["opbc/is/veto_fraction"] = (lr().abs() > DEFAULT_VETO).float().mean().item()
    out["opbc/logprob/abs_diff_mean"] = lr().abs().mean().item()
    out["opbc/logprob/abs_diff_max"] = lr().abs().max().item()
    out["opbc/logprob/diff_mean"] = lr().mean().item()
    out["opbc/log_ratio/min"] = lr().min().item()
    out["opbc/log_ratio/max"] = lr().max().item()
    out["opbc/log_ratio/max_abs"] = lr().abs().max().item()
    seq_ok = (m.sum(-1) > 0) & ~(m.bool() & ~(torch.isfinite(t) & torch.isfinite(r))).any(-1)
    s = torch.where(valid(), t - r, 0.0).sum(-1)[seq_ok]
    n = m.sum(-1)[seq_ok]
    seq_w = torch.exp(s.clamp(-c, c))
    out["opbc/is/seq_ess"] = (seq_w.sum() ** 2 / (seq_w.numel() * (seq_w**2).sum())).item()
    out["opbc/sequence/log_ratio_mean"] = s.mean().item()
    out["opbc/sequence/log_ratio_abs_mean"] = s.abs().mean().item()
    out["opbc/sequence/log_ratio_max_abs"] = s.abs().max().item()
    out["opbc/sequence/geo_log_ratio_mean"] = (s / n).mean().item()
    out["opbc/kl/k1"] = (-lr().clamp(-c, c)).mean().item()
    out["opbc/kl/k2"] = (lr().clamp(-c, c) ** 2 / 2).mean().item()
    out["opbc/kl/k3"] = (torch.exp(lr().clamp(-c, c)) - 1 - lr().clamp(-c, c)).mean().item()
    out["opbc/kl/chi2_token"] = ((w() ** 2).mean() - 1).item()
    out["opbc/kl/chi2_seq"] = ((seq_w**2).mean() - 1).item()
    d = -s / n
    out["opbc/ppl/log_ppl_diff"] = d.mean().item()
    out["opbc/ppl/log_ppl_abs_diff"] = d.abs().mean().item()
    out["opbc/ppl/ratio"] = torch.exp(d).mean().item()
    p, q = torch.exp(t[valid()].clamp(max=0.0)), torch.exp(r[valid()].clamp(max=0.0))
    out["opbc/prob/abs_diff_mean"] = (p - q).abs().mean().item()
    out["opbc/prob/abs_diff_max"] = (p - q).abs().max().item()
    out["opbc/prob/pearson"] = torch.corrcoef(torch.stack([p, q]))[0, 1].item()
    out["opbc/prob/diff_std"] = (p - q).abs().std().item()
    out["opbc/input/nonfinite_count"] = (m.bool() & ~(torch.isfinite(t) & torch.isfinite(r))).sum().item()
    out["opbc/input/num_tokens"] = valid().sum().item()
    out["opbc/input/num_sequences"] = seq_ok.sum().item()
    return out


# -- moe --------------------------------------------------------------------------------------------------
def naive_moe(rollout: Tensor, trainer: Tensor, m: Tensor) -> dict[str, float]:
    """Top-1 flips per layer with ``.item()`` each; the top-K sets compared after sorting each row."""
    out: dict[str, float] = {}
    valid = m.bool()
    flips = (rollout[..., 0] != trainer[..., 0])[valid]  # [N, L]
    out["moe/router/flip_rate"] = flips.float().mean().item()
    rates = [flips[:, layer].float().mean().item() for layer in range(flips.shape[1])]
    worst = max(range(len(rates)), key=lambda i: rates[i])
    out["moe/router/worst_layer"] = float(worst)
    out["moe/router/worst_layer_flip_rate"] = rates[worst]
    for layer, rate in enumerate(rates):
        out[f"moe/router/layer_{layer}/flip_rate"] = rate
    differs = (rollout.sort(dim=-1).values != trainer.sort(dim=-1).values).any(dim=-1).any(dim=-1)
    out["moe/router/topk_disagreement_rate"] = differs[valid].float().mean().item()
    return out


# -- per round, as verl PR #5229 --------------------------------------------------------------------------
def _find_contiguous_segments(mask_1d: Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of 1s in a 1-D mask, walking it in Python."""
    segments, start = [], None
    for i, v in enumerate(mask_1d.tolist()):
        if v and start is None:
            start = i
        elif not v and start is not None:
            segments.append((start, i))
            start = None
    if start is not None:
        segments.append((start, len(mask_1d)))
    return segments


def naive_per_round(train_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """``_calculate_per_round_metrics``: per sequence its rounds, per round index the batch's tokens pooled."""
    round_diffs: dict[int, list[Tensor]] = defaultdict(list)
    max_rounds = 0
    for b in range(response_mask.shape[0]):
        segments = _find_contiguous_segments(response_mask[b])
        max_rounds = max(max_rounds, len(segments))
        for i, (start, end) in enumerate(segments):
            round_diffs[i].append((train_log_probs[b, start:end] - rollout_log_probs[b, start:end]).abs())
    out: dict[str, float] = {"per_round/total_rounds": float(max_rounds)}
    means = {}
    for i in range(max_rounds):
        diffs = torch.cat(round_diffs[i])
        means[i] = diffs.mean().item()
        out[f"per_round/round_{i}_abs_diff_mean"] = means[i]
        out[f"per_round/round_{i}_token_count"] = float(diffs.numel())
    worst = max(means, key=lambda i: means[i]) if means else -1
    out["per_round/max_round_diff"] = float(worst)
    out["per_round/max_diff_value"] = means[worst] if means else 0.0
    return out


# -- agent and endpoint -----------------------------------------------------------------------------------
def _call_keys(traj: Trajectory) -> set[tuple[str, str]]:
    return {(c.name, hashlib.sha256(c.arguments.encode()).hexdigest()) for s in traj.steps for c in s.tool_calls}


def _divergence(a: Trajectory, b: Trajectory) -> tuple[int, str] | None:
    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        if x.tool_names != y.tool_names:
            return i, "tool_choice"
        if [c.arguments for c in x.tool_calls] != [c.arguments for c in y.tool_calls]:
            return i, "tool_arguments"
        if not x.tool_calls and " ".join(x.content.split()).lower() != " ".join(y.content.split()).lower():
            return i, "content"
    if len(a.steps) != len(b.steps):
        return min(len(a.steps), len(b.steps)), "length"
    return None


def _norm(text: str | None) -> str:
    return " ".join((text or "").split()).lower()


def _f1(a: str, b: str) -> float:
    ta, tb = a.split(), b.split()
    common = sum((Counter(ta) & Counter(tb)).values())
    if not ta or not tb or not common:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def naive_agent(pairs: list[tuple[Trajectory, Trajectory]]) -> dict[str, float]:
    """Each key its own loop over the pairs."""
    n = len(pairs)
    out: dict[str, float] = {}
    jac = []
    for a, b in pairs:
        ka, kb = _call_keys(a), _call_keys(b)
        jac.append(1.0 if not ka and not kb else len(ka & kb) / len(ka | kb))
    out["agent/trajectory/tool_call_jaccard"] = sum(jac) / n
    steps = [d[0] for d in (_divergence(a, b) for a, b in pairs) if d is not None]
    out["agent/trajectory/first_divergence_step_mean"] = sum(steps) / len(steps) if steps else -1.0
    out["agent/trajectory/first_divergence_step_min"] = float(min(steps)) if steps else -1.0
    out["agent/trajectory/diverged_fraction"] = sum(_divergence(a, b) is not None for a, b in pairs) / n
    for kind in ("tool_choice", "tool_arguments", "content", "length"):
        hits = sum(1 for a, b in pairs if (_divergence(a, b) or (0, ""))[1] == kind)
        out[f"agent/trajectory/divergence_kind/{kind}"] = hits / n
    out["agent/trajectory/num_pairs"] = float(n)
    out["agent/answer/match_rate"] = sum(
        bool(_norm(a.final_answer)) and _norm(a.final_answer) == _norm(b.final_answer) for a, b in pairs) / n
    out["agent/answer/soft_match_mean"] = sum(_f1(_norm(a.final_answer), _norm(b.final_answer)) for a, b in pairs) / n
    differ = either = 0
    for a, b in pairs:
        for i in range(max(len(a.steps), len(b.steps))):
            na = a.steps[i].tool_names if i < len(a.steps) else ()
            nb = b.steps[i].tool_names if i < len(b.steps) else ()
            differ += na != nb
            either += bool(na or nb)
    out["agent/steps/tool_choice_disagreement_rate"] = differ / either if either else 0.0
    out["agent/steps/rollout_mean"] = sum(len(a.steps) for a, _ in pairs) / n
    out["agent/steps/reference_mean"] = sum(len(b.steps) for _, b in pairs) / n
    return out


def naive_endpoint(responses: list[dict], requests: list[dict | None]) -> dict[str, float]:
    """Each capability flag its own loop over the (chat completion) responses."""
    n = len(responses)

    def share(flag) -> float:
        return sum(bool(flag(resp, req)) for resp, req in zip(responses, requests)) / n

    def logprobs(resp):
        return [c.get("logprobs") or {} for c in resp["choices"]]

    out = {
        "endpoint/capabilities/token_ids_available": share(
            lambda resp, _: all(c.get("token_ids") for c in resp["choices"])),
        "endpoint/capabilities/prompt_token_ids_available": share(lambda resp, _: bool(resp.get("prompt_token_ids"))),
        "endpoint/capabilities/sampled_logprobs_available": share(
            lambda resp, _: all(lp.get("content") for lp in logprobs(resp))),
        "endpoint/capabilities/top_logprobs_available": share(
            lambda resp, _: all(lp.get("content") and all(e.get("top_logprobs") for e in lp["content"])
                                for lp in logprobs(resp))),
        "endpoint/capabilities/seed_supported": share(
            lambda resp, req: req is not None and req.get("seed") is not None and bool(resp.get("system_fingerprint"))),
        "endpoint/capabilities/seed_requested": share(lambda _, req: req is not None and req.get("seed") is not None),
        "endpoint/capabilities/num_responses": float(n),
    }
    json.dumps(out)  # what a trainer does with the dict next: log it
    return out


def naive_default_keys(batch: dict) -> dict[str, float]:
    """Every key of the default ``OPBCCollection()``, the naive way."""
    t, r, m = batch["trainer_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    return {
        **naive_mismatch(t, r, m),
        **naive_moe(batch["rollout_experts"], batch["trainer_experts"], m),
        **naive_per_round(t, r, m),
        **naive_agent(batch["trajectory_pairs"]),
        **naive_endpoint(batch["endpoint_responses"], batch["endpoint_requests"]),
    }
