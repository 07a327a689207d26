"""Synthetic batches of every section for tests (drifting logprobs, ragged masks, heavy tails, routing, multi-turn
masks, trajectory pairs, endpoint responses, rollout groups, training fields), and hypothesis strategies of
well-formed batches."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import torch
from hypothesis import strategies as st


def make_batch(
    batch: int = 6,
    seq: int = 20,
    seed: int = 0,
    drift: float = 0.3,
    dtype: torch.dtype = torch.float32,
    heavy_tail: bool = False,
    empty_rows: int = 0,
) -> dict[str, torch.Tensor]:
    """Trainer/rollout logprobs with a right-padded response mask; ``empty_rows`` rows are all masked."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 4.0
    if heavy_tail:
        # Pareto-like tails: a Gaussian divided by U^(2/3) has tail index 1.5.
        u = torch.rand(batch, seq, generator=g, dtype=torch.float64).clamp_min(1e-12)
        noise = torch.randn(batch, seq, generator=g, dtype=torch.float64) / u ** (2 / 3) * drift
    else:
        noise = torch.randn(batch, seq, generator=g, dtype=torch.float64) * drift
    rollout = (trainer - noise).clamp(max=0.0)  # logprobs are <= 0
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    if empty_rows:
        mask[:empty_rows] = 0
    group_ids = torch.arange(batch) // 2
    return {
        "trainer_logprobs": trainer.to(dtype),
        "rollout_logprobs": rollout.to(dtype),
        "response_mask": mask,
        "group_ids": group_ids,
    }


def concat_batches(batches: list[dict]) -> dict:
    """Concatenate along the batch dim: tensors of rank >= 2 right-padded along dim 1 with masked zeros,
    lists joined, mappings (``sample_metrics``) concatenated per entry."""
    seq = max((v.shape[1] for b in batches for v in b.values() if isinstance(v, torch.Tensor) and v.ndim >= 2),
              default=0)
    out: dict = {}
    for b in batches:
        for k, v in b.items():
            out.setdefault(k, []).append(v)
    return {k: _concat(parts, seq) for k, parts in out.items()}


def _concat(parts: list, seq: int):
    if isinstance(parts[0], dict):
        return {n: _concat([p[n] for p in parts], seq) for n in parts[0]}
    if isinstance(parts[0], torch.Tensor):
        padded = [torch.nn.functional.pad(v, [0, 0] * (v.ndim - 2) + [0, seq - v.shape[1]]) if v.ndim >= 2 else v
                  for v in parts]
        return torch.cat(padded)
    return [x for p in parts for x in p]


def logprobs_numpy(batch: dict) -> tuple:
    """(trainer, rollout, mask) as NumPy arrays, the logprobs in float64: the references' inputs."""
    return (batch["trainer_logprobs"].double().numpy(), batch["rollout_logprobs"].double().numpy(),
            batch["response_mask"].numpy())


# --- MoE routing -------------------------------------------------------------------------------------
def make_router_batch(batch=4, seq=10, layers=3, k=2, experts=8, seed=0, swap=0.2, replace=0.15, empty_rows=0):
    """Distinct top-K ids per (token, layer); the trainer swaps the top two (top-1 flip, same set) or
    replaces the last expert with one outside the set (set differs), at the given rates."""
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((batch, seq, layers, experts)), axis=-1)
    rollout = order[..., :k].copy()
    trainer = rollout.copy()
    if k > 1:
        sw = rng.random((batch, seq, layers)) < swap
        trainer[sw, 0], trainer[sw, 1] = rollout[sw, 1], rollout[sw, 0]
    if k < experts:
        rep = rng.random((batch, seq, layers)) < replace
        trainer[rep, k - 1] = order[rep, k]  # an expert outside the rollout's top-K
    lengths = rng.integers(1, seq + 1, size=batch)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    mask[:empty_rows] = 0
    return {
        "rollout_experts": torch.from_numpy(rollout),
        "trainer_experts": torch.from_numpy(trainer),
        "response_mask": torch.from_numpy(mask),
    }


@st.composite
def router_batches(draw, max_b=4, max_t=6, max_l=3, max_k=3):
    b, t, layers, k = (draw(st.integers(1, most)) for most in (max_b, max_t, max_l, max_k))
    experts = draw(st.integers(k, k + 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((b, t, layers, experts)), axis=-1)
    rollout = order[..., :k]
    # Trainer: draw each expert id freely from [0, E) (so any overlap with the rollout's set can occur).
    trainer = rng.integers(0, experts, size=(b, t, layers, k))
    keep = rng.random((b, t, layers)) < draw(st.floats(0.0, 1.0))
    trainer = np.where(keep[..., None], rollout, trainer)
    mask = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    return {
        "rollout_experts": torch.from_numpy(rollout.copy()),
        "trainer_experts": torch.from_numpy(trainer),
        "response_mask": torch.tensor(mask).view(b, t),
    }


# --- multi-turn masks ---------------------------------------------------------------------------------
def multi_turn_batch(batch=5, seq=40, seed=0, p_on=0.55, p_switch=0.25, drift=0.3, dtype=torch.float64,
                     empty_rows=0):
    """Masks made of alternating runs (a two-state Markov chain): many rounds of random lengths."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for b in range(batch):
        state = rng.random() < p_on
        for t in range(seq):
            mask[b, t] = state
            if rng.random() < p_switch:
                state = not state
    mask[:empty_rows] = 0
    trainer = -rng.random((batch, seq)) * 4.0
    # A drift that grows with the round, so the worst round is not round 0.
    rounds = np.maximum(np.cumsum(np.diff(mask, axis=1, prepend=0) == 1, axis=1) - 1, 0)
    rollout = np.minimum(trainer - rng.normal(size=(batch, seq)) * drift * (1 + rounds), 0.0)
    return {
        "trainer_logprobs": torch.from_numpy(trainer).to(dtype),
        "rollout_logprobs": torch.from_numpy(rollout).to(dtype),
        "response_mask": torch.from_numpy(mask),
    }


def round_batches(max_b=5, max_t=12):
    """Logprob batches with 0/1 int masks, 1 twice as likely: many rounds of random lengths. (Other mask values
    are refused at compute: tests/test_standalone_input_checks.py.)"""
    return logprob_batches(max_b, max_t, mask=st.sampled_from([0, 1, 1]))


# --- logprob batches (hypothesis) -----------------------------------------------------------------------
finite_logprobs = st.floats(-30.0, 0.0, allow_nan=False, width=64)


@st.composite
def logprob_batches(draw, max_b=6, max_t=8, mask=None):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    trainer = draw(st.lists(finite_logprobs, min_size=b * t, max_size=b * t))
    rollout = draw(st.lists(finite_logprobs, min_size=b * t, max_size=b * t))
    mask = draw(st.lists(st.booleans() if mask is None else mask, min_size=b * t, max_size=b * t))
    return {
        "trainer_logprobs": torch.tensor(trainer, dtype=torch.float64).view(b, t),
        "rollout_logprobs": torch.tensor(rollout, dtype=torch.float64).view(b, t),
        "response_mask": torch.tensor(mask).view(b, t),
    }


# --- agent trajectory pairs ----------------------------------------------------------------------------
TOOLS = ["search", "calc", "open_url"]
CONTENTS = ["Paris", " paris ", "The answer\nis 42", "the answer is   42", "ok", "", None, "Ok."]
# Argument texts as models write them: key order and spacing vary; some are malformed or blank.
ARGUMENTS = ['{"q": "x"}', '{ "q":"x" }', '{"q": "y"}', '{"k": 1, "q": "x"}', '{"q": "x", "k": 1}', '{"q": ',
             '{"q": ', "not json", "", None, "[1, 2]", '{"q": "é"}', '{"q": "\\u00e9"}']


def random_messages(rng: random.Random, max_steps: int = 4):
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "task"}]
    n = rng.randint(1, max_steps)
    for i in range(n):
        msg = {"role": "assistant", "content": rng.choice(CONTENTS)}
        k = rng.choice([0, 0, 1, 1, 2])
        if k:
            msg["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": rng.choice(TOOLS), "arguments": rng.choice(ARGUMENTS)}}
                for j in range(k)
            ]
        msgs.append(msg)
        if k:
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}_0", "content": "result"})
    return msgs


def mutate(rng: random.Random, msgs):
    out = copy.deepcopy(msgs)
    assistant = [m for m in out if m["role"] == "assistant"]
    what = rng.randrange(5)
    target = rng.choice(assistant)
    if what == 0:
        target["content"] = rng.choice(CONTENTS)
    elif what == 1 and target.get("tool_calls"):
        target["tool_calls"][0]["function"]["arguments"] = rng.choice(ARGUMENTS)
    elif what == 2 and target.get("tool_calls"):
        target["tool_calls"][0]["function"]["name"] = rng.choice(TOOLS)
    elif what == 3 and len(assistant) > 1:
        out = out[: next(i for i, m in enumerate(out) if m is assistant[-1])]  # ends early
    elif what == 4:
        out.append({"role": "assistant", "content": rng.choice(CONTENTS)})
    return out


def random_pairs(seed: int, n: int):
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a = random_messages(rng)
        r = rng.random()
        b = copy.deepcopy(a) if r < 0.3 else mutate(rng, a) if r < 0.8 else random_messages(rng)
        pairs.append((a, b))
    return pairs


@st.composite
def message_lists(draw):
    return random_messages(random.Random(draw(st.integers(0, 2**32 - 1))))


@st.composite
def pair_lists(draw, max_size=8):
    n = draw(st.integers(0, max_size))
    seed = draw(st.integers(0, 2**32 - 1))
    return random_pairs(seed, n)


# --- endpoint responses --------------------------------------------------------------------------------
def random_exchange(rng: random.Random):
    chat = rng.random() < 0.5
    n_tokens = rng.randint(0, 3)  # zero-token generations included
    id_tokens = rng.choice(["all", "none", "none", "some"])  # tokens as `token_id:<int>`: all, none or some
    choices = []
    for i in range(rng.choice([1, 1, 2])):
        tokens = [f"token_id:{rng.randint(0, 150000)}" if id_tokens == "all" or (id_tokens == "some" and rng.random()
                  < 0.5) else rng.choice(["Hi", "!", " there"]) for _ in range(n_tokens)]
        choice = {"index": i, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x" * n_tokens}
        else:
            choice["text"] = "x" * n_tokens
        r = rng.random()
        if r < 0.3:
            choice["logprobs"] = None
        elif r < 0.4:
            pass  # field absent
        else:
            # Top-k alternatives at every position, at none, or at some (a partial answer is not coverage).
            top_mode = rng.choice(["all", "none", "some"])
            with_top = [top_mode == "all" or (top_mode == "some" and rng.random() < 0.5) for _ in tokens]
            if chat:
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": -0.5, "bytes": None,
                     "top_logprobs": [{"token": t, "logprob": -0.5, "bytes": None}] if top else []}
                    for t, top in zip(tokens, with_top)]}
            else:
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": [None if (j == 0 and rng.random() < 0.3) else -0.5 for j in range(n_tokens)],
                    "top_logprobs": None if top_mode == "none" and rng.random() < 0.5 else [
                        {t: -0.5} if top else rng.choice([{}, None]) for t, top in zip(tokens, with_top)],
                    "text_offset": list(range(n_tokens)),
                }
        t = rng.random()
        if t < 0.4:
            choice["token_ids"] = [rng.randint(0, 150000) for _ in range(n_tokens)]
        elif t < 0.5:
            choice["token_ids"] = None
        if not chat and rng.random() < 0.4:
            choice["prompt_token_ids"] = [1, 2, 3]
        choices.append(choice)
    resp = {"id": "r", "object": "chat.completion" if chat else "text_completion", "created": 0, "model": "m",
            "choices": choices}
    if rng.random() < 0.4:
        resp["prompt_token_ids"] = [151644, 872]
    f = rng.random()
    if f < 0.4:
        resp["system_fingerprint"] = "fp_0123456789"
    elif f < 0.6:
        resp["system_fingerprint"] = None
    s = rng.random()
    req = None if s < 0.2 else {"seed": rng.randint(0, 9)} if s < 0.6 else {"seed": None} if s < 0.8 else {}
    return resp, req


def random_exchanges(seed: int, n: int):
    rng = random.Random(seed)
    return [random_exchange(rng) for _ in range(n)]


@st.composite
def exchange_lists(draw, max_size=10):
    return random_exchanges(draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, max_size)))


def split_exchanges(exchanges):
    return [resp for resp, _ in exchanges], [req for _, req in exchanges]


# --- rollout groups ------------------------------------------------------------------------------------
NAMES = ("tool_calls", "format")
STOP_STRINGS = ("stop", "length", "abort", "tool_calls")


def make_rollouts(groups: int = 4, seed: int = 0, first_id: int = 0, tokens: bool = False, t: int = 6,
                  missing: bool = True) -> dict:
    """A batch of whole prompt groups (sizes 1-5, interleaved), ids ``first_id * 1000 + 37 k`` (arbitrary ints)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, groups)
    gid = np.concatenate([np.full(s, first_id * 1000 + 37 * k - 50) for k, s in enumerate(sizes)])
    rng.shuffle(gid)  # a group need not be contiguous in the batch
    b = gid.size
    rewards = rng.choice([0.0, 0.5, 1.0, 2.0], size=b) * rng.integers(0, 2, b)
    lengths = rng.integers(0, 200, b)
    out = {
        "group_ids": torch.tensor(gid),
        "prompt_lengths": torch.tensor(rng.integers(5, 100, b)),
        "response_lengths": torch.tensor(lengths),
        "stop_reasons": [STOP_STRINGS[i] for i in rng.integers(0, 4, b)],
        "discard_reasons": torch.tensor(rng.integers(0, 3, b)),
    }
    tool_calls = rng.integers(0, 5, b).astype(np.float64)
    fmt = rng.random(b)
    if missing:
        fmt[rng.random(b) < 0.3] = np.nan  # not reported by some samples
    out["sample_metrics"] = {"tool_calls": torch.tensor(tool_calls), "format": torch.tensor(fmt)}
    out["policy_lag"] = torch.tensor(rng.integers(0, 5, b))
    if tokens:
        mask = (np.arange(t)[None, :] < rng.integers(0, t + 1, b)[:, None]).astype(np.int64)
        out["response_mask"] = torch.tensor(mask)
        out["rewards"] = torch.tensor(rng.normal(size=(b, t)))
        out["advantages"] = torch.tensor(rng.normal(size=(b, t)))
    else:
        out["rewards"] = torch.tensor(rewards)
        out["advantages"] = torch.tensor(rng.normal(size=b))
    return out


@st.composite
def rollout_groups(draw, max_groups=5):
    """A list of whole groups: (id, [(reward, length, stop, discard, metric or None), ...])."""
    ids = draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=max_groups, unique=True))
    sample = st.tuples(st.sampled_from([0.0, 0.25, 1.0, 3.0]), st.integers(0, 64), st.sampled_from(STOP_STRINGS),
                       st.integers(0, 2), st.one_of(st.none(), st.floats(0.0, 10.0)))
    return [(gid, draw(st.lists(sample, min_size=1, max_size=5))) for gid in ids]


def groups_batch(groups) -> dict:
    rows = [(gid, s) for gid, samples in groups for s in samples]
    return {
        "group_ids": torch.tensor([g for g, _ in rows], dtype=torch.long),
        "rewards": torch.tensor([s[0] for _, s in rows], dtype=torch.float64),
        "advantages": torch.tensor([s[0] - 1.0 for _, s in rows], dtype=torch.float64),
        "prompt_lengths": torch.tensor([abs(g) % 17 for g, _ in rows], dtype=torch.long),  # one prompt per group
        "response_lengths": torch.tensor([s[1] for _, s in rows], dtype=torch.long),
        "stop_reasons": [s[2] for _, s in rows],
        "discard_reasons": torch.tensor([s[3] for _, s in rows], dtype=torch.long),
        "sample_metrics": {
            "tool_calls": torch.tensor([float(s[1] % 5) for _, s in rows], dtype=torch.float64),
            "format": torch.tensor([math.nan if s[4] is None else s[4] for _, s in rows], dtype=torch.float64),
        },
    }


# --- training batches ----------------------------------------------------------------------------------
def make_training_batch(batch: int = 6, seq: int = 12, vocab: int = 7, seed: int = 0, empty_rows: int = 0,
                        dtype: torch.dtype = torch.float64) -> dict:
    """All training-section fields for ``batch`` sequences; right-padded response mask; ``empty_rows``
    sequences have no response token (aborted)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[:empty_rows] = 0
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 3.0
    new = (old + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)  # logprobs
    logits = randn(batch, seq, vocab, scale=2.0)
    rewards = torch.zeros(batch, seq, dtype=torch.float64)
    rewards[torch.arange(batch), (lengths - 1).clamp_min(0)] = torch.randint(0, 2, (batch,), generator=g).double()
    return {
        "policy_logprobs": new.to(dtype),
        "old_logprobs": old.to(dtype),
        "response_mask": mask,
        "advantages": randn(batch, seq),
        "values": randn(batch, seq, scale=2.0) + 1.0,
        "returns": randn(batch, seq, scale=2.0) + 1.5,
        "rewards": rewards.to(dtype),
        "scores": randn(batch),
        "logits": logits,
        "entropies": torch.rand(batch, seq, generator=g, dtype=torch.float64).to(dtype) * 2.0,
        "prompt_lengths": torch.randint(5, 40, (batch,), generator=g),
        "response_lengths": lengths.clone(),
        "num_turns": torch.randint(1, 6, (batch,), generator=g),
        "policy_chosen_logps": randn(batch, scale=3.0) - 20.0,
        "policy_rejected_logps": randn(batch, scale=3.0) - 22.0,
        "reference_chosen_logps": randn(batch, scale=3.0) - 21.0,
        "reference_rejected_logps": randn(batch, scale=3.0) - 21.0,
        "chosen_scores": randn(batch) + 0.5,
        "rejected_scores": randn(batch),
        "agent_generate_s": torch.rand(batch, generator=g, dtype=torch.float64) * 10.0,
        "agent_tool_calls_s": torch.rand(batch, generator=g, dtype=torch.float64) * 3.0,
    }


def make_validation_batch(prompts: int = 4, n: int = 4, seed: int = 0, sources=("gsm8k", "math", "aime")) -> dict:
    """Validation results of ``prompts`` prompts (sources in turn) with ``n`` samples each; some samples are
    masked out (a prompt may have none valid)."""
    g = torch.Generator().manual_seed(seed)
    return {"val_acc": (torch.rand(prompts, n, generator=g) < 0.5).double(),
            "val_rewards": torch.randn(prompts, n, generator=g, dtype=torch.float64).round(decimals=2),
            "val_mask": torch.rand(prompts, n, generator=g) < 0.8,
            "data_sources": [sources[(seed + i) % len(sources)] for i in range(prompts)],
            "val_num_turns": torch.randint(1, 5, (prompts, n), generator=g)}


def make_steps(steps: int = 1, seed: int = 0, rows: int = 4) -> dict:
    """``{"steps": [...]}``: per-step updates of one rank (stage times and the step's sequence lengths); every
    second step has no ``old_log_prob`` time (a stage a step did not run is not timed: its mean is over the steps
    that ran it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        times = (0.1 + torch.rand(4, generator=g, dtype=torch.float64) * 3).tolist()
        timing = {s: t for s, t in zip(("gen", "update_actor", "old_log_prob", "step"), times) if i % 2 == 0 or
                  s != "old_log_prob"}
        out.append({"timing_s": timing, "prompt_lengths": torch.randint(5, 40, (rows,), generator=g),
                    "response_lengths": torch.randint(0, 60, (rows,), generator=g)})
    return {"steps": out}


SCALARS = ("actor_loss", "pg_loss", "entropy_loss", "kl_loss", "kl_coef", "actor_grad_norm", "actor_lr",
           "critic_loss", "critic_lr", "rm_grad_norm")


def make_scalars(n: int = 2, seed: int = 0) -> dict:
    """Trainer scalars: ``n`` observations each (lists of floats) and ``loss_tokens`` weights."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {name: (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5).tolist() for name in SCALARS}
    out["loss_tokens"] = torch.randint(10, 500, (n,), generator=g).tolist()
    out["lr_scheduler"] = {"last_lr": (torch.rand(n, generator=g, dtype=torch.float64) * 1e-5).tolist()}
    return out


# --- controller steps ------------------------------------------------------------------------------------
def grouped_batch(batch: int = 8, seq: int = 12, seed: int = 0, **kwargs) -> dict:
    """Logprobs (float64) of ``batch`` sequences in up to four prompt groups whose ids are unique to ``seed``
    (batches of different seeds share no group), with a policy lag per sequence; ``batch=0`` is empty."""
    b = make_batch(batch=max(batch, 1), seq=seq, seed=seed, dtype=torch.float64, **kwargs)
    b = {k: v[:batch] for k, v in b.items()}
    g = torch.Generator().manual_seed(seed)
    b["group_ids"] = torch.randint(0, 4, (batch,), generator=g) * 1000 + seed
    b["policy_lag"] = torch.randint(0, 10, (batch,), generator=g)
    return b


def metric_values(metric, *batches) -> dict:
    """Update ``metric`` (or a collection) with ``batches``, then its computed keys as floats."""
    for b in batches:
        metric.update(b)
    return {k: v.item() for k, v in getattr(metric, "compute_dict", metric.compute)().items()}
