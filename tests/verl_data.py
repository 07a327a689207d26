"""verl step batches for the verl and Ray tests (verl and tensordict are imported where used: this module
imports without them)."""

from __future__ import annotations

import uuid

import numpy as np
import torch

TIMING_RAW = {"start_profile": 0.001, "gen": 2.5, "reward": 0.3, "old_log_prob": 0.7, "values": 0.4, "adv": 0.05,
              "update_critic": 0.9, "update_actor": 1.6, "stop_profile": 0.002, "step": 6.8}


def make_dataproto(n_prompts: int = 4, n: int = 4, prompt_width: int = 6, response_width: int = 9, seed: int = 0):
    """A step batch as verl's RayPPOTrainer holds it after the advantage computation: left-padded prompts,
    right-padded responses, n rollouts per prompt (interleaved), an agent-loop tool span masked out of
    ``response_mask``, turn counts, a critic."""
    from verl.protocol import DataProto

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    b = n_prompts * n
    p_len = rng.integers(1, prompt_width + 1, b)
    r_len = rng.integers(1, response_width + 1, b)  # no aborted (empty) response
    r_len[0] = response_width  # one clipped response
    attention = torch.zeros(b, prompt_width + response_width, dtype=torch.int64)
    response_mask = torch.zeros(b, response_width, dtype=torch.int64)
    for i in range(b):
        attention[i, prompt_width - p_len[i] : prompt_width + r_len[i]] = 1
        response_mask[i, : r_len[i]] = 1
        if i % 3 == 0 and r_len[i] >= 5:
            response_mask[i, 2:4] = 0  # tool output inside the response
    old = -torch.rand(b, response_width, generator=g) * 3
    rollout = (old + 0.2 * torch.randn(b, response_width, generator=g)).clamp(max=-1e-3)  # logprobs are <= 0
    scores = torch.zeros(b, response_width)
    for i in range(b):
        scores[i, r_len[i] - 1] = float(rng.integers(0, 2))
    rewards = scores - 0.01 * torch.rand(b, response_width, generator=g) * response_mask  # a KL-in-reward penalty
    values = torch.randn(b, response_width, generator=g)
    returns = values + torch.randn(b, response_width, generator=g)
    uids = [str(uuid.UUID(int=int(rng.integers(1 << 62)))) for _ in range(n_prompts)]
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.randint(3, 100, (b, prompt_width), generator=g),
            "responses": torch.randint(3, 100, (b, response_width), generator=g),
            "attention_mask": attention,
            "response_mask": response_mask,
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": torch.randn(b, response_width, generator=g),
            "returns": returns,
            "values": values,
        },
        non_tensors={
            "uid": np.array([u for u in uids for _ in range(n)], dtype=object),
            "__num_turns__": rng.integers(1, 6, b).astype(np.int32),
        },
        meta_info={"global_token_num": attention.sum(-1).tolist()},
    )
    return data


def v1_transfer_queue_form(data):
    """The step's fields as the V1 trainer stores them in TransferQueue: jagged per-sequence tensors
    (verl's own ``response_to_nested``), ``uid`` and ``num_turns`` as non-tensor data."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    b = data.batch
    resp_len = b["attention_mask"][:, b["prompts"].shape[1]:].sum(-1)
    prompt_len = b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1)
    nested_mask = torch.nested.as_nested_tensor([b["response_mask"][i, : resp_len[i]] for i in range(len(resp_len))],
                                                layout=torch.jagged)
    fields = {name: response_to_nested(b[name], nested_mask)
              for name in ("old_log_probs", "rollout_log_probs", "advantages", "returns", "values", "responses")}
    fields["rm_scores"] = response_to_nested(b["token_level_scores"], nested_mask)
    fields["response_mask"] = nested_mask
    fields["prompts"] = torch.nested.as_nested_tensor(
        [b["prompts"][i, b["prompts"].shape[1] - prompt_len[i]:] for i in range(len(prompt_len))], layout=torch.jagged)
    td = TensorDict(fields, batch_size=[len(resp_len)])
    td["uid"] = data.non_tensor_batch["uid"].tolist()
    td["num_turns"] = data.non_tensor_batch["__num_turns__"].tolist()
    return td
