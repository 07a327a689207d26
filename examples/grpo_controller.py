"""GRPO with the Off-Policy Budget Controller, in a plain PyTorch loop (CPU, a few seconds).

Run: ``python examples/grpo_controller.py [steps]``.

A toy policy emits ``T`` tokens per prompt; the reward is the share of tokens equal to the prompt's target
token. The "rollout engine" samples from a copy of the policy whose logits carry numerical noise (as a
bf16 / fp8 engine would) and, for some groups, from a stale snapshot (asynchronous rollouts). Some steps
also inject an engine bug (a NaN logprob) or a catastrophic token. Each step:

1. the trainer scores the sampled tokens (``trainer_logprobs``, no grad: the old policy of the PPO ratio);
2. ``controller.step(batch)`` decides every group at once and returns the token-level ``loss_mask`` and the
   importance ``weights`` (here: truncated IS with a weight cap of 2, the value most RL frameworks use,
   applied to every trained token);
3. the clipped GRPO loss is weighted by them; groups sent to ``replay`` wait in a buffer and come back
   next step, re-scored by the newer trainer (their lag grows; past ``max_lag`` they are quarantined);
4. the budget metrics (``opbc/decision/*``) tell what share of the data each action took.
"""

from __future__ import annotations

import collections
import copy
import sys

import torch
from torch import nn

from opbc_metrics.controller import OPBCController

VOCAB, T, PROMPTS, GROUP, GROUPS_PER_STEP = 16, 12, 8, 4, 6


class TinyPolicy(nn.Module):
    """Logits for each position given the prompt (non-autoregressive, enough for a toy)."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = nn.Embedding(PROMPTS, 32)
        self.position = nn.Embedding(T, 32)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:  # [B] -> [B, T, V]
        h = self.prompt(prompts)[:, None, :] + self.position.weight[None, :, :]
        return self.out(torch.tanh(h))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def rollout(engine: TinyPolicy, prompts: torch.Tensor, noise: float, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Sample from the engine's (noisy) distribution; return tokens and the engine's logprobs."""
    with torch.no_grad():
        logits = engine(prompts)
        logits = logits + noise * torch.randn(logits.shape, generator=g)
        tokens = torch.multinomial(torch.softmax(logits, -1).view(-1, VOCAB), 1, generator=g).view(len(prompts), T)
        return tokens, token_logprobs(logits, tokens)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Reward minus the group mean, over the group std (rows of a group are contiguous, GROUP each)."""
    r = rewards.view(-1, GROUP)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    return adv.view(-1)


def main(steps: int = 40, seed: int = 0, verbose: bool = True) -> dict[str, float]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    policy = TinyPolicy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-2)
    snapshots: collections.deque[TinyPolicy] = collections.deque(maxlen=12)
    controller = OPBCController("truncated_is")
    replay: list[dict[str, torch.Tensor]] = []
    next_group = 0
    rewards_seen = []
    for step in range(steps):
        snapshots.appendleft(copy.deepcopy(policy))
        # -- rollouts: one group per prompt, mostly fresh; one group from a stale snapshot -----------
        parts = []
        for k in range(GROUPS_PER_STEP):
            lag = 0 if k else min(step % 11, len(snapshots) - 1)
            prompt = torch.randint(0, PROMPTS, (1,), generator=g).expand(GROUP)
            tokens, logp = rollout(snapshots[lag], prompt, noise=0.05, g=g)
            parts.append({
                "prompts": prompt, "tokens": tokens, "rollout_logprobs": logp,
                "group_ids": torch.full((GROUP,), next_group), "policy_lag": torch.full((GROUP,), lag),
            })
            next_group += 1
        if step % 5 == 3:
            parts[1]["rollout_logprobs"][0, 3] = float("nan")  # an engine bug: this group is rejected
        if step % 7 == 5:
            parts[2]["rollout_logprobs"][1, 0] = -50.0  # a catastrophic token: vetoed, quarantined
        for old in replay:  # replayed groups come back one step staler
            parts.append(dict(old, policy_lag=old["policy_lag"] + 1))
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        rewards = (batch["tokens"] == (batch["prompts"] % VOCAB)[:, None]).float().mean(1)
        advantages = grpo_advantages(rewards, batch["group_ids"])

        # -- the trainer scores the samples; the controller decides every group at once --------------
        with torch.no_grad():
            batch["trainer_logprobs"] = token_logprobs(policy(batch["prompts"]), batch["tokens"])
        # (prompts and tokens are this loop's own fields: passing them would warn that nothing reads them)
        out = controller.step({k: v for k, v in batch.items() if k not in ("prompts", "tokens")})
        replay = [out.select(batch, "replay")] if out.rows("replay").numel() else []
        replay = [{k: v for k, v in r.items() if k != "trainer_logprobs"} for r in replay]

        # -- clipped GRPO loss with the controller's mask and importance weights ---------------------
        mask = out.loss_mask.float()
        for _ in range(2):  # two PPO epochs on the batch
            new_logp = token_logprobs(policy(batch["prompts"]), batch["tokens"])
            ratio = torch.exp(new_logp - batch["trainer_logprobs"])
            adv = advantages[:, None]
            pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * out.weights
            loss = (pg * mask).sum() / mask.sum().clamp_min(1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rewards_seen.append(rewards.mean().item())
        if verbose:
            counts = collections.Counter(d.action.value for d in out.decisions)
            print(f"step {step:3d}  reward {rewards.mean().item():.3f}  loss {loss.item(): .4f}  {dict(counts)}")

    budget = {k: v.item() for k, v in controller.compute_budget().items()}
    summary = {**budget, "reward_first": sum(rewards_seen[:5]) / 5, "reward_last": sum(rewards_seen[-5:]) / 5}
    if verbose:
        for key, value in budget.items():
            if value:
                print(f"{key:<50} {value:.4g}")
        print(f"reward: first 5 steps {summary['reward_first']:.3f} -> last 5 steps {summary['reward_last']:.3f}")
    return summary


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
