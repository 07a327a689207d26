"""verl step batches for the verl and Ray tests (verl and tensordict are imported where used: this module
imports without them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TIMING_RAW = {"start_profile": 0.001, "gen": 2.5, "reward": 0.3, "old_log_prob": 0.7, "values": 0.4, "adv": 0.05,
              "update_critic": 0.9, "update_actor": 1.6, "stop_profile": 0.002, "step": 6.8}


class FakeTensorDict(dict):
    """The parts of tensordict.TensorDict the adapters may touch: mapping access and ``batch_size``."""

    def __init__(self, data: dict[str, Any], batch_size: list[int]) -> None:
        super().__init__(data)
        self.batch_size = torch.Size(batch_size)


@dataclass
class FakeDataProto:
    """verl.protocol.DataProto's layout without verl: ``batch`` (a TensorDict: a mapping),
    ``non_tensor_batch`` (dict of numpy arrays), ``meta_info`` (dict)."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class VerlStep:
    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    prompt_lengths: list[int]
    response_lengths: list[int]
    tool_spans: list[tuple[int, int]]  # per row, [start, end) of an environment span inside the response
    uids: list[str]  # per row
    rewards: list[float]  # per row, the score on the last response token
    data: Any = None  # the fields wrapped as the trainer holds them


def verl_step(n_prompts: int = 4, n: int = 4, prompt_width: int = 6, response_width: int = 9, seed: int = 0, *,
              empty: bool = False, kl_penalty: float = 0.01, dtype: torch.dtype = torch.float32) -> VerlStep:
    """A step batch as verl's RayPPOTrainer holds it after the advantage computation: left-padded prompts,
    right-padded responses, n rollouts per prompt interleaved as ``batch.repeat(repeat_times=n, interleave=True)``
    leaves them, an agent-loop tool span masked out of ``response_mask`` in some rows, turn counts, a critic.
    Row 1's response is empty with ``empty``, else row 0's is clipped; ``kl_penalty`` scales the KL-in-reward
    penalty that makes ``token_level_rewards`` differ from ``token_level_scores``."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    b = n_prompts * n
    p_len = rng.integers(1, prompt_width + 1, b).tolist()
    r_len = rng.integers(1, response_width + 1, b).tolist()
    r_len[1 if empty else 0] = 0 if empty else response_width
    attention = torch.zeros(b, prompt_width + response_width, dtype=torch.int64)
    response_mask = torch.zeros(b, response_width, dtype=torch.int64)
    spans = [(2, 4) if i % 3 == 0 and r_len[i] >= 5 else (0, 0) for i in range(b)]
    for i in range(b):
        attention[i, prompt_width - p_len[i] : prompt_width + r_len[i]] = 1
        response_mask[i, : r_len[i]] = 1
        response_mask[i, spans[i][0] : spans[i][1]] = 0  # tool output inside the response
    old = (-torch.rand(b, response_width, generator=g, dtype=torch.float64) * 3).to(dtype)
    rollout = (old + 0.2 * torch.randn(b, response_width, generator=g, dtype=torch.float64).to(dtype)).clamp(max=-1e-3)
    rewards = [float(rng.integers(0, 2)) if r else 0.0 for r in r_len]
    scores = torch.zeros(b, response_width)
    for i in range(b):
        if r_len[i]:
            scores[i, r_len[i] - 1] = rewards[i]
    values = torch.randn(b, response_width, generator=g)
    uids = [str(uuid.UUID(int=int(rng.integers(1 << 62)))) for _ in range(n_prompts)]
    tensors = {
        "prompts": torch.randint(3, 100, (b, prompt_width), generator=g),
        "responses": torch.randint(3, 100, (b, response_width), generator=g),
        "input_ids": torch.randint(3, 100, (b, prompt_width + response_width), generator=g),
        "attention_mask": attention, "position_ids": torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0),
        "response_mask": response_mask, "old_log_probs": old, "rollout_log_probs": rollout,
        "token_level_scores": scores,
        "token_level_rewards": scores - kl_penalty * torch.rand(b, response_width, generator=g) * response_mask,
        "advantages": torch.randn(b, response_width, generator=g),
        "returns": values + torch.randn(b, response_width, generator=g), "values": values,
    }
    row_uids = [u for u in uids for _ in range(n)]
    non_tensors = {"uid": np.array(row_uids, dtype=object), "__num_turns__": rng.integers(1, 6, b).astype(np.int32)}
    return VerlStep(tensors, non_tensors, p_len, r_len, spans, row_uids, rewards)


def make_dataproto(n_prompts: int = 4, n: int = 4, prompt_width: int = 6, response_width: int = 9, seed: int = 0):
    """:func:`verl_step` as a verl ``DataProto``."""
    from verl.protocol import DataProto

    step = verl_step(n_prompts, n, prompt_width, response_width, seed)
    return DataProto.from_dict(tensors=step.tensors, non_tensors=step.non_tensors,
                               meta_info={"global_token_num": step.tensors["attention_mask"].sum(-1).tolist()})


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
