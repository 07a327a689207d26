"""Bad inputs get an error that names the field the user passed and says what to do: a [B, T] rollout field of
another shape than the response_mask, sparse tensors, a batch on another device than the controller, router logits
whose expert counts differ between the sides, an invalid policy_lag and router logits without top_k."""

from __future__ import annotations

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics import functional as F
from opbc_metrics.controller import OPBCController
from opbc_metrics.functional import rollout as R
from opbc_metrics.rollout.metrics import OffPolicySteps


def _batch(b: int = 4, t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(b, t, generator=g)
    return {"trainer_logprobs": trainer, "rollout_logprobs": trainer - 0.01 * torch.rand(b, t, generator=g),
            "response_mask": torch.ones(b, t)}


# -- 1. a [B, T] rollout field whose shape is not the response_mask's ---------------------------------------
@pytest.mark.parametrize("field", ["rewards", "advantages"])
@pytest.mark.parametrize("width", [1, 7], ids=["B,1", "B,T+1"])
def test_a_token_field_of_another_shape_than_the_mask_is_named_with_its_fix(field, width):
    batch = {**_batch(), field: torch.ones(4, width)}
    expected = (rf"^batch field `{field}` has shape \(4, {width}\) but `response_mask` has shape \(4, 6\): give "
                rf"`{field}` the response_mask's shape \[B, T\] = \(4, 6\).* or \[B\]")
    with pytest.raises(ValueError, match=expected):
        OPBCCollection(sections=["mismatch", "rollout"]).update(batch)


def test_a_mask_of_another_shape_than_the_logprobs_and_rewards_is_the_field_named():
    """The mask is at fault when the token field has the logprobs' shape: verl's attention_mask [B, P+T]."""
    batch = {**_batch(), "rewards": torch.ones(4, 6), "response_mask": torch.ones(4, 9)}
    with pytest.raises(ValueError, match=r"^batch field `response_mask` has shape \(4, 9\) but `trainer_logprobs` has "
                                         r"shape \(4, 6\): .*`response_mask\[:, -6:\]`"):
        OPBCCollection(sections=["rollout"]).update(batch)


# -- 2. sparse tensors -------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("field", ["trainer_logprobs", "response_mask"])
@pytest.mark.parametrize("to_sparse", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
def test_a_sparse_field_is_refused_naming_it_and_to_dense(field, to_sparse):
    batch = _batch()
    batch[field] = to_sparse(batch[field])
    expected = rf"batch field `{field}` is a sparse tensor .*`{field}.to_dense\(\)`"
    with pytest.raises(ValueError, match=expected):
        OPBCCollection()(batch)
    with pytest.raises(ValueError, match=expected):
        OPBCController().step({**batch, "group_ids": torch.tensor([0, 0, 1, 1])})
    with pytest.raises(ValueError, match=expected):
        F.importance_ess(**batch)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_field_is_refused_naming_it_and_to_padded_tensor(layout):
    batch = _batch()
    batch["rollout_logprobs"] = torch.nested.nested_tensor(list(batch["rollout_logprobs"]), layout=layout)
    with pytest.raises(ValueError, match=r"batch field `rollout_logprobs` is a nested tensor.*to_padded_tensor"):
        OPBCCollection()(batch)


def test_a_sparse_per_sequence_field_is_refused():
    batch = {**_batch(), "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]).to_sparse()}
    with pytest.raises(ValueError, match=r"batch field `rewards` is a sparse tensor .*`rewards.to_dense\(\)`"):
        OPBCCollection(sections=["rollout"]).update(batch)


# -- 3. a batch on another device than the controller's budget metrics --------------------------------------
def test_a_batch_on_another_device_than_the_controller_names_its_fields_and_controller_to():
    batch = {**_batch(), "group_ids": torch.tensor([0, 0, 1, 1])}
    controller = OPBCController()
    expected = (r"batch field\(s\) `trainer_logprobs`, `rollout_logprobs`, `response_mask`, `group_ids` are on meta "
                r"but the states of the controller's budget metrics are on cpu; .*controller\.to\(\"meta\"\)")
    with pytest.raises(ValueError, match=expected) as raised:
        controller.step({k: v.to("meta") for k, v in batch.items()})
    assert "opbc_decisions" not in str(raised.value)
    # nothing was folded into the budget: the same batch on the controller's device steps as usual
    out = controller.step(batch)
    assert [d.action.value for d in out.decisions] == ["train", "train"]
    assert controller.compute_budget()["opbc/decision/group_share/train"].item() == 1.0
    # without a budget there are no states to disagree with
    assert OPBCController(track_budget=False).step({k: v.to("meta") for k, v in batch.items()}) is not None


# -- 4. router logits whose expert counts differ between the sides ----------------------------------------
def _router_batch(e_rollout: int, e_trainer: int) -> dict[str, torch.Tensor]:
    t = torch.full((2, 4), -1.0)
    g = torch.Generator().manual_seed(1)
    return {"trainer_logprobs": t, "rollout_logprobs": t,
            "rollout_router_logits": torch.randn(2, 4, 1, e_rollout, generator=g),
            "trainer_router_logits": torch.randn(2, 4, 1, e_trainer, generator=g)}


def test_the_controller_rejects_router_logits_of_different_expert_counts_as_a_shape_mismatch():
    controller = OPBCController(track_budget=False)
    out = controller.step(**_router_batch(8, 64), group_ids=torch.tensor([0, 1]))
    assert [(d.action.value, [r.value for r in d.reasons]) for d in out.decisions] == [
        ("reject", ["shape_mismatch"]), ("reject", ["shape_mismatch"])]
    assert not out.loss_mask.any()
    same = controller.step(**_router_batch(8, 8), group_ids=torch.tensor([0, 1]))
    assert all("shape_mismatch" not in [r.value for r in d.reasons] for d in same.decisions)


E_MISMATCH = (r"batch field `trainer_router_logits` has E = 64 experts \(shape \(2, 4, 1, 64\)\) but "
              r"`rollout_router_logits` has E = 8 \(shape \(2, 4, 1, 8\)\)")


def test_the_collection_refuses_router_logits_of_different_expert_counts():
    with pytest.raises(ValueError, match=E_MISMATCH):
        OPBCCollection(section_options={"moe": {"top_k": 2}}).update(_router_batch(8, 64))
    batch = _router_batch(8, 64)
    with pytest.raises(ValueError, match=E_MISMATCH):
        F.router_flip_rate(batch["rollout_router_logits"], batch["trainer_router_logits"], top_k=1)
    OPBCCollection(section_options={"moe": {"top_k": 2}}).update(_router_batch(8, 8))


# -- 5. misleading messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), -1.0], ids=["nan", "negative"])
def test_an_invalid_policy_lag_is_named_with_its_rule(bad):
    lag = torch.tensor([1.0, bad, 0.0, 0.0])
    expected = r"batch field `policy_lag` held 1 invalid value\(s\) \(.*lag.*finite.* >= 0.*\)"
    collection = OPBCCollection(sections=["mismatch", "rollout"])
    collection.update({**_batch(), "policy_lag": lag})
    with pytest.raises(ValueError, match=expected) as raised:
        collection.compute()
    assert "token counts" not in str(raised.value)
    metric = OffPolicySteps()
    metric.update(policy_lag=lag)
    with pytest.raises(ValueError, match=expected):
        metric.compute()
    with pytest.raises(ValueError, match=expected):
        R.off_policy_steps(lag)


def test_router_logits_without_top_k_say_how_to_set_it_on_a_collection():
    batch = _router_batch(8, 8)
    with pytest.raises(ValueError, match=r"`rollout_router_logits` holds router logits.*"
                                         r"section_options=\{\"moe\": \{\"top_k\": K\}\}"):
        OPBCCollection().update(batch)
    with pytest.raises(ValueError, match=r"`top_k=K`"):
        F.router_flip_rate(batch["rollout_router_logits"], batch["trainer_router_logits"])
