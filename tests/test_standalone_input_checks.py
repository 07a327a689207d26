"""A mismatch metric used alone, and a functional call, refuse what InputHealth refuses in a collection:
probabilities or logits passed as logprobs, and a response_mask with values other than 0 and 1."""

from __future__ import annotations

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics import functional as F
from opbc_metrics.mismatch import MISMATCH_METRICS, InputHealth
from opbc_metrics.per_round import PerRoundMismatch

ALONE = [cls for cls in MISMATCH_METRICS if cls is not InputHealth] + [PerRoundMismatch]
FUNCTIONS = ["chi_square", "clipped_fraction", "importance_ess", "importance_weight_mean",
             "importance_weight_second_moment", "importance_weight_std", "kl_estimators", "log_ratio_range",
             "logprob_diff", "per_round_mismatch", "perplexity_gap", "probability_diff", "sequence_ess",
             "sequence_log_ratio", "top_gradient_mass", "veto_fraction"]


def _logprobs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(3, 40, generator=g) * 4
    return trainer, trainer - 0.05 * torch.rand(3, 40, generator=g)


@pytest.mark.parametrize("cls", ALONE, ids=lambda c: c.__name__)
def test_a_metric_alone_refuses_probabilities_and_a_non_binary_mask(cls):
    trainer, rollout = _logprobs()
    probabilities = cls()
    probabilities.update(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())
    with pytest.raises(ValueError, match="`trainer_logprobs` holds values in \\[0, 1\\] only"):
        probabilities.compute()
    labels = cls()
    labels.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=torch.full(trainer.shape, 2))
    with pytest.raises(ValueError, match="`response_mask` held 120 value"):
        labels.compute()
    with pytest.raises(ValueError, match="logits, rewards or scores"):  # forward: the batch's own value
        cls()(trainer_logprobs=trainer + 3.0, rollout_logprobs=rollout)


@pytest.mark.parametrize("cls", ALONE, ids=lambda c: c.__name__)
def test_the_checks_change_no_value(cls):
    trainer, rollout = _logprobs(1)
    alone, unchecked = cls(), cls(input_checks=False)
    for m in (alone, unchecked):
        m.update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    got, want = alone.compute(), unchecked.compute()
    got, want = (x if isinstance(x, dict) else {"value": x} for x in (got, want))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert len(alone.state_dict()) == len(unchecked.state_dict()) + 3


def test_collection_members_leave_the_checks_to_input_health():
    metrics = OPBCCollection()
    members = [m for m in metrics.members() if type(m) in ALONE]
    assert len(members) == len(ALONE) and not any(m.input_checks for m in members)
    trainer, rollout = _logprobs()
    with pytest.raises(ValueError, match="probabilities"):
        metrics(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())
    # without the mismatch section (no InputHealth), per_round checks on its own
    (per_round,) = OPBCCollection(sections=["per_round"]).members()
    assert per_round.input_checks
    with pytest.raises(ValueError, match="probabilities"):
        OPBCCollection(sections=["per_round"])(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_functional_call_refuses_probabilities_and_a_non_binary_mask(name):
    trainer, rollout = _logprobs()
    fn = getattr(F, name)
    with pytest.raises(ValueError, match="`rollout_logprobs` holds values in \\[0, 1\\] only"):
        fn(trainer, rollout.exp())
    with pytest.raises(ValueError, match="`response_mask` held"):
        fn(trainer, rollout, torch.full(trainer.shape, 2))
    fn(trainer, rollout)  # logprobs and a 0/1 mask pass
