"""No field the user passed is silently ignored: a known field that no metric of a collection reads is reported
once per collection and field, naming the section that reads it; rollout/trainer token ids given to a collection
with the mismatch section are compared, and logprobs of different tokens are refused at compute()."""

from __future__ import annotations

import warnings

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.batch import UnreadFieldWarning, known_field_names
from opbc_metrics.collection import field_readers
from opbc_metrics.mismatch import InputHealth
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch
from tests.ddp import count_collectives, run_distributed

EXTRA = {"rewards": torch.ones(4), "policy_lag": torch.zeros(4), "stop_reasons": ["stop", "length", "stop", "stop"]}


def _batch(seed: int = 0) -> dict:
    return {**make_batch(batch=4, seq=6, seed=seed), **EXTRA}  # (make_batch carries group_ids)


def _unread(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnreadFieldWarning)]


def _recorded(fn, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return _unread(caught)


# -- (a) known fields no metric of the collection reads --------------------------------------------------------
def test_known_fields_no_member_reads_are_reported_once_per_collection_naming_the_section():
    metrics = OPBCCollection()
    first = _recorded(metrics.update, _batch())
    assert len(first) == 1
    message = first[0]
    for field in ("rewards", "group_ids", "policy_lag", "stop_reasons"):
        assert f"`{field}`" in message
    assert "rollout" in message and 'sections=[..., "rollout"]' in message
    assert "once" in message
    # the same collection: not again, not after a reset, not from forward
    assert _recorded(metrics.update, _batch(1)) == []
    metrics.reset()
    assert _recorded(metrics, _batch(2)) == []
    # a new field later: reported once, alone
    again = _recorded(metrics.update, {**_batch(3), "advantages": torch.zeros(4)})
    assert len(again) == 1 and "`advantages`" in again[0] and "`rewards`" not in again[0]
    # another collection reports for itself
    assert len(_recorded(OPBCCollection().update, _batch())) == 1


def test_forward_reports_unread_fields_too():
    assert len(_recorded(OPBCCollection(), _batch())) == 1


def test_fields_the_collection_reads_are_not_reported():
    metrics = OPBCCollection(sections=["mismatch", "rollout"])
    assert _recorded(metrics.update, _batch()) == []
    assert _recorded(OPBCCollection().update, make_batch(batch=4, seq=6, seed=0) | {"group_ids": None}) == []


def test_every_known_field_has_a_reader_or_is_said_to_have_none():
    readers = field_readers()
    for name in known_field_names():
        assert name in readers, name
    assert readers["rewards"][0] == "rollout" and "training" in readers["rewards"]
    assert readers["rollout_token_ids"] == readers["trainer_token_ids"] == ("mismatch",)
    assert readers["rollout_experts"] == ("moe",) and readers["group_ids"] == ("rollout",)


def test_a_field_no_section_reads_is_said_so(monkeypatch):
    import opbc_metrics.batch as B

    monkeypatch.setattr(B, "OPTIONAL_FIELDS", (*B.OPTIONAL_FIELDS, "future_field"))
    message = _recorded(OPBCCollection().update, {**make_batch(batch=2, seq=3), "future_field": torch.ones(2)})
    assert len(message) == 1 and "`future_field`" in message[0] and "no section" in message[0]


def test_token_ids_without_the_mismatch_section_name_it():
    batch = make_batch(batch=2, seq=3)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    message = _recorded(OPBCCollection(sections=["per_round"]).update,
                        {**batch, "group_ids": None, "rollout_token_ids": ids, "trainer_token_ids": ids})
    assert len(message) == 1 and "`rollout_token_ids`" in message[0] and 'sections=[..., "mismatch"]' in message[0]


def test_misspellings_are_still_refused_and_unknown_fields_still_warned():
    batch = make_batch(batch=2, seq=3)
    batch["respons_mask"] = batch.pop("response_mask")
    with pytest.raises(ValueError, match="did you mean `response_mask`"):
        OPBCCollection().update(batch)
    with pytest.warns(UserWarning, match=r"`input_ids` not read by opbc-metrics: ignored"):
        OPBCCollection().update({**make_batch(batch=2, seq=3), "input_ids": torch.ones(2, 3)})


def test_an_adapters_batch_reports_its_unread_fields_once():
    """verl's adapter maps every field it finds (rewards, lengths, groups): the default collection behind
    VerlMetrics reports those it does not read once, and logs its keys as before."""
    from opbc_metrics.integrations._common import OPBCIntegrationWarning
    from opbc_metrics.integrations.verl import VerlMetrics
    from tests.test_integration_adapters import make_verl_case

    m = VerlMetrics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.observe_logprobs(make_verl_case(seed=1).data)
        m.observe_logprobs(make_verl_case(seed=2).data)
    assert not [w for w in caught if issubclass(w.category, OPBCIntegrationWarning)]
    unread = _unread(caught)
    assert len(unread) == 1 and "`rewards`" in unread[0] and "`group_ids`" in unread[0]
    assert m.compute()["opbc/input/num_tokens"] > 0


# -- (b) token ids -----------------------------------------------------------------------------------------------
def _with_ids(batch: dict, differ: int, dtype: torch.dtype = torch.int64) -> dict:
    """Token ids equal on every position but the first ``differ`` response tokens of row 0 (and a masked one)."""
    shape = batch["trainer_logprobs"].shape
    rollout_ids = torch.arange(shape[0] * shape[1], dtype=dtype).reshape(shape)
    trainer_ids = rollout_ids.clone()
    mask = batch["response_mask"].clone()
    mask[0, : max(differ, 1)] = 1
    mask[-1, -1] = 0
    trainer_ids[0, :differ] += 1
    trainer_ids[-1, -1] += 1  # off the response: not compared
    return {**batch, "response_mask": mask, "rollout_token_ids": rollout_ids, "trainer_token_ids": trainer_ids}


def test_equal_token_ids_pass_and_are_read():
    metrics = OPBCCollection()
    batch = _with_ids(make_batch(batch=3, seq=5, seed=1), differ=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreadFieldWarning)
        metrics.update({**batch, "group_ids": None})
    assert metrics.compute()["opbc/input/num_tokens"].item() > 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_different_token_ids_are_counted_without_a_sync_and_refused_at_compute(dtype):
    metrics = OPBCCollection()
    with assert_no_host_sync():
        metrics.update(_with_ids(make_batch(batch=3, seq=5, seed=1), differ=2, dtype=dtype))
        metrics.update(_with_ids(make_batch(batch=3, seq=5, seed=2), differ=1, dtype=dtype))
    with pytest.raises(ValueError, match=r"`rollout_token_ids` and `trainer_token_ids` differ on 3 response "
                                         r"token\(s\).*logprobs are of different tokens.*align"):
        metrics.compute()
    metrics.reset()
    metrics.update(_with_ids(make_batch(batch=3, seq=5, seed=3), differ=0, dtype=dtype))
    metrics.compute()  # a new window


def test_input_health_alone_refuses_different_tokens_and_forward_restores_the_window():
    metric = InputHealth()
    good = _with_ids(make_batch(batch=3, seq=5, seed=1), differ=0)
    metric.update(good)
    with pytest.raises(ValueError, match="differ on 1 response token"):
        metric(_with_ids(make_batch(batch=3, seq=5, seed=1), differ=1))
    assert metric.token_ids_differ.item() == 0.0
    metric.compute()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: {**b, "trainer_token_ids": b["trainer_token_ids"][:, :-1]},
         r"`trainer_token_ids` has shape \(3, 4\) but `trainer_logprobs` has shape \(3, 5\)"),
        (lambda b: {**b, "rollout_token_ids": b["rollout_token_ids"].float()},
         r"`rollout_token_ids` must be an integer tensor.*float32"),
        (lambda b: {**b, "trainer_token_ids": b["trainer_token_ids"] > 3},
         r"`trainer_token_ids` must be an integer tensor.*bool"),
        (lambda b: {**b, "rollout_token_ids": b["rollout_token_ids"].tolist()},
         r"`rollout_token_ids` must be a torch.Tensor"),
        (lambda b: {**b, "trainer_token_ids": None}, r"`trainer_token_ids` is required when `rollout_token_ids`"),
        (lambda b: {**b, "rollout_token_ids": None}, r"`rollout_token_ids` is required when `trainer_token_ids`"),
    ],
)
def test_bad_token_ids_are_refused_at_update_naming_the_field(change, match):
    metrics = OPBCCollection()
    before = {k: v.clone() for k, v in metrics.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        metrics.update(change(_with_ids(make_batch(batch=3, seq=5, seed=1), differ=0)))
    after = metrics.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_the_token_id_check_uses_the_controllers_comparison():
    """The controller rejects a group for token_ids_mismatch on the same positions the collection counts."""
    from opbc_metrics import OPBCController
    from opbc_metrics.functional.controller import token_ids_differ
    from opbc_metrics.policy import Reason

    batch = _with_ids(make_batch(batch=4, seq=5, seed=1), differ=2)
    mask = batch["response_mask"] != 0
    rows = token_ids_differ(mask, batch["rollout_token_ids"], batch["trainer_token_ids"])
    assert rows.tolist() == [2, 0, 0, 0]
    decisions = OPBCController(track_budget=False).step(batch).decisions
    rejected = {d.group_id for d in decisions if Reason.TOKEN_IDS_MISMATCH in d.reasons}
    assert rejected == {0}


def _token_ids_worker(rank, world_size, differ):
    from opbc_metrics import OPBCCollection

    metrics = OPBCCollection()
    batch = _with_ids(make_batch(batch=3, seq=5, seed=rank), differ=differ[rank])
    metrics.update(batch)
    with count_collectives() as calls:
        try:
            metrics.compute()
            outcome = "no error"
        except ValueError as err:
            outcome = str(err)
    plain = OPBCCollection()
    plain.update(make_batch(batch=3, seq=5, seed=rank))
    with count_collectives() as plain_calls:
        plain.compute()
    return outcome, calls["n"], plain_calls["n"]


@pytest.mark.parametrize("differ", [(1, 2), (0, 2), (0, 0)], ids=["both_ranks", "rank1_only", "none"])
def test_token_id_differences_are_summed_over_ranks(differ):
    results = run_distributed(_token_ids_worker, world_size=2, args=(differ,), timeout=180)
    total = sum(differ)
    for outcome, n, plain_n in results:
        if total:
            assert f"differ on {total} response token(s)" in outcome, outcome
        else:
            assert outcome == "no error"
        assert n == plain_n  # the count travels in the collection's packed sync: no collective of its own
