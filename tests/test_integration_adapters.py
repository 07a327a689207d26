"""verl and TRL adapters on faithful fixtures: a fake DataProto with verl's attribute layout, and a dict
shaped like the output of TRL GRPOTrainer._generate_and_score_completions. Expected values are built
independently (plain Python loops over the fixture's construction parameters)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCCollection, host_floats
from opbc_metrics.integrations._common import ids_to_group_ids
from opbc_metrics.integrations.trl import trl_to_batch
from opbc_metrics.integrations.verl import verl_to_batch
from opbc_metrics.testing import assert_no_host_sync
from tests.data import multi_turn_batch
from tests.verl_data import FakeDataProto, FakeTensorDict, VerlStep, verl_step


# -- verl fixture --------------------------------------------------------------------------------
def make_verl_case(seed: int = 0) -> VerlStep:
    """6 rows (3 prompts, 2 rollouts each) of 7 response tokens, row 1 empty, rewards without a KL penalty, in
    a fake DataProto."""
    step = verl_step(3, 2, prompt_width=5, response_width=7, seed=seed, empty=True, kl_penalty=0.0,
                     dtype=torch.float64)
    step.data = FakeDataProto(FakeTensorDict(step.tensors, [6]), step.non_tensors, {"global_steps": 1})
    return step


def assert_same_values(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_verl_dataproto_maps_every_field():
    case = make_verl_case()
    out = verl_to_batch(case.data)
    assert out["trainer_logprobs"] is case.data.batch["old_log_probs"]
    assert out["rollout_logprobs"] is case.data.batch["rollout_log_probs"]
    assert out["response_mask"] is case.data.batch["response_mask"]  # the agent-loop mask wins
    assert out["group_ids"].tolist() == [list(dict.fromkeys(case.uids)).index(u) for u in case.uids]  # first seen
    assert out["group_ids"].dtype == torch.int64
    assert out["prompt_lengths"].tolist() == case.prompt_lengths
    assert out["response_lengths"].tolist() == case.response_lengths
    assert out["rewards"].tolist() == case.rewards
    assert out["advantages"] is case.data.batch["advantages"]
    assert all(not out["response_mask"][row, start:end].any() for row, (start, end) in enumerate(case.tool_spans))


def test_verl_derives_response_mask_from_attention_mask_like_compute_response_mask():
    case = make_verl_case(seed=1)
    del case.data.batch["response_mask"]
    out = verl_to_batch(case.data)
    for i, length in enumerate(case.response_lengths):
        assert out["response_mask"][i].tolist() == [1] * length + [0] * (7 - length)


def test_verl_flat_dict_and_tensor_uids_and_offset():
    case = make_verl_case(seed=2)
    flat = {**case.data.batch, **case.data.non_tensor_batch}
    assert_same_values(verl_to_batch(flat), verl_to_batch(case.data))
    flat["uid"] = torch.tensor([7, 7, 3, 3, 9, 9])
    assert verl_to_batch(flat, group_offset=100)["group_ids"].tolist() == [107, 107, 103, 103, 109, 109]
    assert ids_to_group_ids(["z", "a", "z"], offset=5).tolist() == [5, 6, 5]


def test_verl_collection_values_equal_a_schema_batch_built_by_hand():
    case = make_verl_case(seed=3)
    by_adapter, by_hand = OPBCCollection(), OPBCCollection()
    with assert_no_host_sync():  # neither the adapter nor the update
        by_adapter.update(verl_to_batch(case.data))
    mask = torch.tensor([[int(j < length and not start <= j < end) for j in range(7)]
                         for length, (start, end) in zip(case.response_lengths, case.tool_spans)])
    by_hand.update(trainer_logprobs=case.data.batch["old_log_probs"].clone(),
                   rollout_logprobs=case.data.batch["rollout_log_probs"].clone(), response_mask=mask)
    assert_same_values(by_adapter.compute(), by_hand.compute())


def test_verl_clear_errors():
    case = make_verl_case(seed=5)
    del case.data.batch["rollout_log_probs"]
    with pytest.raises(ValueError, match=r"`rollout_log_probs`.*calculate_log_probs"):
        verl_to_batch(case.data)
    out = verl_to_batch(case.data, require_logprobs=False)
    assert "rollout_logprobs" not in out and "trainer_logprobs" in out
    del case.data.batch["old_log_probs"]
    with pytest.raises(ValueError, match=r"`old_log_probs`"):
        verl_to_batch(case.data)
    bad = make_verl_case(seed=6)
    bad.data.batch["attention_mask"] = bad.data.batch["attention_mask"][:, :3]
    with pytest.raises(ValueError, match=r"`attention_mask`"):
        verl_to_batch(bad.data)
    with pytest.raises(TypeError, match="verl batch"):
        verl_to_batch(42)


@pytest.mark.parametrize("field", ["token_level_scores", "token_level_rewards", "rm_scores"])
def test_verl_per_token_rewards_of_another_width_are_refused(field):
    case = make_verl_case(seed=9)
    b = case.data.batch
    scores = b["token_level_scores"]
    wide = torch.cat([scores, torch.ones(scores.shape[0], 1)], dim=1)  # T_resp + 1: a prompt/EOS column too
    if field == "rm_scores":  # V1's name, read when token_level_scores is absent
        del b["token_level_scores"]
    b[field] = wide
    with pytest.raises(ValueError, match=rf"`{field}` has {wide.shape[1]} columns but the response width is "
                                         rf"{scores.shape[1]}"):
        verl_to_batch(case.data)


def test_verl_explicit_schema_logprobs_and_verls_names_together_are_refused():
    case = make_verl_case(seed=10)
    b = case.data.batch
    b["trainer_logprobs"] = b["old_log_probs"] + 0.5  # a second tensor for the same field
    with pytest.raises(ValueError, match=r"both `trainer_logprobs` and `old_log_probs`.*trainer_key"):
        verl_to_batch(case.data)
    out = verl_to_batch(case.data, trainer_key="trainer_logprobs")  # the way to read the schema field
    assert out["trainer_logprobs"] is b["trainer_logprobs"]
    b["trainer_logprobs"] = b["old_log_probs"]  # the same tensor under both names: nothing is lost
    assert verl_to_batch(case.data)["trainer_logprobs"] is b["old_log_probs"]
    b["rollout_logprobs"] = b["rollout_log_probs"].clone()
    with pytest.raises(ValueError, match=r"both `rollout_logprobs` and `rollout_log_probs`"):
        verl_to_batch(case.data)


# -- TRL fixture ---------------------------------------------------------------------------------
def make_trl_inputs(b: int = 6, prompt_width: int = 4, completion_width: int = 6, tools: bool = False, seed: int = 0):
    """The dict GRPOTrainer._generate_and_score_completions returns (vLLM with IS correction on)."""
    rng = np.random.default_rng(seed)
    prompt_lengths = [int(rng.integers(1, prompt_width + 1)) for _ in range(b)]
    completion_lengths = [int(rng.integers(1, completion_width + 1)) for _ in range(b)]
    prompt_mask = torch.tensor([[0] * (prompt_width - p) + [1] * p for p in prompt_lengths])  # left padding
    completion_mask = torch.tensor([[1] * c + [0] * (completion_width - c) for c in completion_lengths])
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, completion_width, generator=g) * 2
    sampling = old + 0.1 * torch.randn(b, completion_width, generator=g)
    inputs: dict[str, Any] = {
        "prompt_ids": torch.randint(3, 50, (b, prompt_width), generator=g), "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, 50, (b, completion_width), generator=g), "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g), "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": old, "sampling_per_token_logps": sampling,
        "importance_sampling_ratio": torch.exp(old - sampling).clamp(max=2.0)}
    if tools:
        tool_mask = torch.ones(b, completion_width, dtype=torch.int64)
        tool_mask[:, 1:3] = 0  # a tool result inserted after the first generated token
        inputs["tool_mask"] = tool_mask
    return inputs, prompt_lengths, completion_lengths


def test_trl_inputs_map_every_field_with_global_group_ids():
    inputs, prompt_lengths, completion_lengths = make_trl_inputs()
    out = trl_to_batch(inputs, num_generations=4, process_index=1)
    assert out["trainer_logprobs"] is inputs["old_per_token_logps"]
    assert out["rollout_logprobs"] is inputs["sampling_per_token_logps"]
    assert out["response_mask"] is inputs["completion_mask"]
    # process 1 holds global rows 6..11; prompts repeat in blocks of 4: groups 1,1,2,2,2,2
    assert out["group_ids"].tolist() == [(6 + i) // 4 for i in range(6)] == [1, 1, 2, 2, 2, 2]
    assert out["prompt_lengths"].tolist() == prompt_lengths
    assert out["response_lengths"].tolist() == completion_lengths
    assert out["advantages"] is inputs["advantages"]
    assert "group_ids" not in trl_to_batch(inputs)  # no grouping information given
    assert trl_to_batch(inputs, group_ids=["a", "a", "b", "b", "c", "c"])["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]


def trl_loss_mask(completion_lengths: list[int]) -> list[list[int]]:
    """Completion tokens outside the tool span (tokens 1 and 2), as TRL's loss masks them."""
    return [[int(j < c and not 1 <= j < 3) for j in range(6)] for c in completion_lengths]


def test_trl_tool_mask_is_combined_like_trls_loss():
    inputs, _, completion_lengths = make_trl_inputs(tools=True, seed=1)
    assert trl_to_batch(inputs, num_generations=2)["response_mask"].int().tolist() == trl_loss_mask(completion_lengths)


def test_trl_collection_values_equal_a_schema_batch_built_by_hand():
    inputs, _, completion_lengths = make_trl_inputs(tools=True, seed=2)
    by_adapter, by_hand = OPBCCollection(), OPBCCollection()
    with assert_no_host_sync():
        by_adapter.update(trl_to_batch(inputs, num_generations=3))
    mask = torch.tensor(trl_loss_mask(completion_lengths))
    by_hand.update(trainer_logprobs=inputs["old_per_token_logps"].clone(),
                   rollout_logprobs=inputs["sampling_per_token_logps"].clone(), response_mask=mask)
    got = by_adapter.compute()
    assert_same_values(got, by_hand.compute())
    # The importance ratio TRL logs is exp(old - sampling) on the same tokens: our mean weight matches
    # its unclipped mean when nothing is clipped at 2.0.
    ratio = torch.exp(inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).double()
    assert float(ratio.max()) < 2.0
    assert got["opbc/is/weight_mean"].item() == pytest.approx(float(ratio[mask.bool()].mean()), rel=1e-6)


def test_trl_clear_errors():
    inputs, _, _ = make_trl_inputs(seed=3)
    no_sampling = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    with pytest.raises(ValueError, match=r"`sampling_per_token_logps`.*use_vllm"):
        trl_to_batch(no_sampling)
    assert "rollout_logprobs" not in trl_to_batch(no_sampling, require_logprobs=False)
    with pytest.raises(ValueError, match=r"`old_per_token_logps`"):
        trl_to_batch({k: v for k, v in inputs.items() if k != "old_per_token_logps"})
    with pytest.raises(ValueError, match=r"`completion_mask`"):
        trl_to_batch({k: v for k, v in inputs.items() if k != "completion_mask"})
    with pytest.raises(ValueError, match=r"`tool_mask`"):
        trl_to_batch({**inputs, "tool_mask": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="num_generations"):
        trl_to_batch(inputs, num_generations=0)
    with pytest.raises(ValueError, match="group_ids"):
        trl_to_batch(inputs, group_ids=[1, 2])


# -- verl fields the training section reads, bypass mode, and what the integrations log ----------
def test_verl_maps_scores_turns_and_v1_lengths():
    case = make_verl_case(seed=7)
    case.data.non_tensor_batch["__num_turns__"] = np.array([1, 2, 3, 1, 2, 3], dtype=np.int32)
    case.data.batch["token_level_scores"][0, 0] += 0.5  # scores differ from rewards
    out = verl_to_batch(case.data)
    assert out["num_turns"].tolist() == [1, 2, 3, 1, 2, 3]
    assert out["scores"].tolist() == [r + (0.5 if i == 0 else 0.0) for i, r in enumerate(case.rewards)]
    assert out["rewards"].tolist() == case.rewards
    v1 = {"old_log_probs": torch.zeros(2, 3), "rollout_log_probs": torch.zeros(2, 3), "response_mask": torch.ones(2, 3),
          "rm_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), "num_turns": torch.tensor([2, 4]),
          "prompt_length": torch.tensor([5.0, 7.0]), "response_length": torch.tensor([3.0, 2.0])}
    out = verl_to_batch(v1)
    assert out["scores"].tolist() == [1.0, 0.0] and out["rewards"].tolist() == [1.0, 0.0]
    assert out["prompt_lengths"].tolist() == [5.0, 7.0] and out["response_lengths"].tolist() == [3.0, 2.0]
    assert out["num_turns"].tolist() == [2, 4]


def test_bypass_is_detected_and_the_window_logs_no_mismatch():
    from opbc_metrics.integrations._common import OPBCIntegrationWarning
    from opbc_metrics.integrations.verl import VerlMetrics, is_bypass

    case = make_verl_case(seed=8)
    case.data.batch["old_log_probs"] = case.data.batch["rollout_log_probs"]
    assert is_bypass(case.data)
    m = VerlMetrics()
    with pytest.warns(OPBCIntegrationWarning, match="bypass"):
        m.observe_logprobs(case.data)
    assert m.compute() == {}
    assert not is_bypass(make_verl_case(seed=8).data)


def test_loggable_drops_windows_without_data_and_fills_nothing():
    from opbc_metrics.integrations._common import loggable

    zeros = {"opbc/input/nonfinite_count": torch.tensor(0.0), "opbc/input/num_tokens": torch.tensor(0.0),
             "opbc/input/num_sequences": torch.tensor(0.0)}
    assert loggable(zeros) == {}
    assert loggable({**zeros, "opbc/is/ess": torch.tensor(1.0)}, logprob_window=True) == {}
    with_data = {**zeros, "opbc/input/num_tokens": torch.tensor(3.0), "opbc/is/ess": torch.tensor(0.5)}
    assert loggable(with_data, logprob_window=True) == {
        "opbc/input/nonfinite_count": 0.0, "opbc/input/num_tokens": 3.0, "opbc/input/num_sequences": 0.0,
        "opbc/is/ess": 0.5}
    assert loggable({"moe/router/flip_rate_per_layer": torch.zeros(4), "critic/score/mean": 2.0}) == {
        "critic/score/mean": 2.0}


def test_host_floats_reads_a_compute_result_in_one_copy_per_dtype(monkeypatch):
    """What the loggers write: every single-element tensor and number as the float ``.item()`` gives, in the
    result's order, read with one ``tolist`` per device and dtype (on a GPU each ``.item()`` is a sync)."""
    values = dict(OPBCCollection()(multi_turn_batch(seed=3, dtype=torch.float32)))
    values.update({"flag": torch.tensor(True), "count": torch.tensor(7), "vector": torch.ones(3), "step": 5,
                   "ok": True, "name": "run", "nested": torch.tensor([[4.0]]),
                   "with_grad": torch.tensor(2.0, requires_grad=True) * 3})
    want = {k: float(v.item()) if isinstance(v, torch.Tensor) else float(v) for k, v in values.items()
            if (isinstance(v, torch.Tensor) and v.numel() == 1) or type(v) in (int, float)}
    dtypes = {v.dtype for v in values.values() if isinstance(v, torch.Tensor) and v.numel() == 1}
    calls = {"item": 0, "tolist": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    got = host_floats(values)
    assert calls == {"item": 0, "tolist": len(dtypes)} and len(dtypes) >= 3
    assert list(got) == list(want) and got == want and len(got) > 40


def test_report_once_warns_once_per_problem():
    from opbc_metrics.integrations._common import OPBCIntegrationWarning, ReportOnce

    report = ReportOnce("here")
    with pytest.warns(OPBCIntegrationWarning) as caught:
        report(ValueError("bad field"))
        report(ValueError("bad field"))
        report("another problem")
    assert len(caught) == 2


def test_trl_explicit_schema_logprobs_and_trls_names_together_are_refused():
    """The same rule as verl's (one shared check): `trainer_logprobs` beside `old_per_token_logps` was dropped."""
    t = -torch.rand(2, 3)
    inputs = {"trainer_logprobs": t, "old_per_token_logps": t - 1.0, "sampling_per_token_logps": t,
              "completion_mask": torch.ones(2, 3)}
    with pytest.raises(ValueError, match=r"both `trainer_logprobs` and `old_per_token_logps`.*trainer_key"):
        trl_to_batch(inputs)
    assert trl_to_batch({**inputs, "old_per_token_logps": t})["trainer_logprobs"] is t
