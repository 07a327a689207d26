"""Trustworthy values: no keys for windows without data, checked merges and loads that drop cached
results, inputs that require grad, refused bad inputs, prefix/postfix, key indexing and plotting."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from opbc_metrics import OPBCCollection, PerRoundMismatch
from opbc_metrics.batch import BatchView
from opbc_metrics.metric import NoDataError
from opbc_metrics.mismatch import ImportanceSamplingESS
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch
from tests.support import assert_values_close

INPUT_KEYS = {"opbc/input/nonfinite_count", "opbc/input/num_tokens", "opbc/input/num_sequences"}
ALL_SECTIONS = ("mismatch", "moe", "per_round", "agent", "endpoint", "rollout", "training")


def _states(collection):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in collection.state_dict().items()}


def _same_states(a, b):  # the same keys, dtypes and values
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- no keys for windows without data ------------------------------------------------------------
@pytest.mark.parametrize("sections", [("mismatch", "moe", "per_round", "agent", "endpoint"), ALL_SECTIONS])
def test_empty_window_reports_only_input_accounting(sections):
    out = OPBCCollection(sections=sections).compute()
    assert set(out) == INPUT_KEYS
    assert all(v.item() == 0 for v in out.values())


@pytest.mark.parametrize("field,fill", [("response_mask", 0), ("rollout_logprobs", float("nan"))],
                         ids=["no_valid_token", "nonfinite_only"])
def test_a_window_without_valid_tokens_counts_but_has_no_statistics(field, fill):
    batch = make_batch(batch=3, seq=5, seed=1)
    batch[field] = torch.full_like(batch[field], fill)
    metrics = OPBCCollection()
    metrics.update(batch)
    out = metrics.compute()
    assert set(out) == INPUT_KEYS and out["opbc/input/num_tokens"] == 0
    assert out["opbc/input/nonfinite_count"] == (batch["response_mask"].sum() if field == "rollout_logprobs" else 0)
    metrics.update(make_batch(batch=3, seq=5, seed=2))
    out = metrics.compute()
    assert "opbc/is/ess" in out and "per_round/total_rounds" in out and out["opbc/input/num_tokens"] > 0


def test_sequence_keys_need_a_valid_sequence():
    batch = make_batch(batch=3, seq=6, seed=4)
    batch["response_mask"] = torch.ones_like(batch["response_mask"])
    batch["rollout_logprobs"][:, 0] = float("-inf")  # every sequence holds a non-finite token
    metrics = OPBCCollection()
    # forward (this batch's values) and compute() (the window's, decided apart: one host read for all members)
    for out in (metrics(batch), metrics.compute()):
        assert out["opbc/input/num_sequences"] == 0 and out["opbc/input/num_tokens"] == 15
        assert "opbc/kl/chi2_token" in out and "opbc/is/ess" in out
        assert not [k for k in out if k.startswith(("opbc/sequence/", "opbc/ppl/")) or k in ("opbc/kl/chi2_seq",
                                                                                              "opbc/is/seq_ess")]


def test_zero_counts_in_a_window_with_data_stay():
    from opbc_metrics.controller import OPBCController

    batch = make_batch(batch=4, seq=6, seed=5, drift=0.0)
    batch["rollout_logprobs"] = batch["trainer_logprobs"].clone()  # every group trains: no reason fires
    controller = OPBCController()
    controller.step(batch)
    out = controller.compute_budget()
    reasons = {k: v for k, v in out.items() if "/reason_count/" in k}
    assert reasons and all(v == 0 for v in reasons.values())
    assert out["opbc/decision/group_share/train"] == 1


def test_standalone_metric_without_data():
    metric = ImportanceSamplingESS()
    with pytest.raises(NoDataError, match="ImportanceSamplingESS saw no data"):
        metric.compute()
    empty = make_batch(batch=2, seq=3, seed=0)
    empty["response_mask"] = torch.zeros_like(empty["response_mask"])
    assert metric(empty) is None  # forward on a batch without data: no value, state kept
    batch = make_batch(batch=2, seq=3, seed=0)
    value = metric(batch)
    assert value is not None and metric.compute() == value


def test_invalid_only_window_still_raises():
    from opbc_metrics.rollout import RolloutRewardStats

    metric = RolloutRewardStats()
    metric.update(rewards=torch.tensor([float("nan"), float("nan")]))
    with pytest.raises(ValueError, match="`rewards`"):
        metric.compute_dict()


# -- merge_state / load_state_dict ---------------------------------------------------------------
def test_merge_and_load_invalidate_the_cache():
    a, b = OPBCCollection(), OPBCCollection()
    a.update(make_batch(seed=1))
    b.update(make_batch(seed=2, drift=2.0))
    before = a.compute()["opbc/is/ess"].item()
    a.merge_state(b.state_dict())
    merged = a.compute()["opbc/is/ess"].item()
    one = OPBCCollection()
    one.update(make_batch(seed=1))
    one.update(make_batch(seed=2, drift=2.0))
    assert merged != before and merged == pytest.approx(one.compute()["opbc/is/ess"].item(), rel=1e-12)
    assert_values_close(a.compute(), one.compute())  # every key, the max / min ones included

    c = OPBCCollection()
    c.update(make_batch(seed=7))
    c.compute()
    c.load_state_dict(b.state_dict())
    assert c.compute()["opbc/is/ess"].item() == b.compute()["opbc/is/ess"].item()

    m = ImportanceSamplingESS()
    m.update(make_batch(seed=1))
    m.compute()
    other = ImportanceSamplingESS()
    other.update(make_batch(seed=2, drift=2.0))
    m.merge_state(other)
    assert m.compute().item() == pytest.approx(one["ImportanceSamplingESS"].compute().item(), rel=1e-12)


MERGE_MISMATCHES = {
    "num_layers": ({"section_options": {"moe": {"num_layers": 4}}}, "(num_layers|configured_layers) differs"),
    "round_capacity": ({"section_options": {"per_round": {"capacity": 3}}}, "capacity differs"),
    "top_mass_bins": ({"top_mass_bins": 512}, "top_mass_bins differs"),
    "clamp": ({"clamp": 5.0}, "clamp differs"),
    "veto": ({"veto": 25.0}, "veto differs"),
    "sections": ({"sections": ("mismatch",)},
                 r"member 'RouterFlipRate'|'RouterFlipRate\._extra_state' does not belong to any member"),
    "top_k": ({"section_options": {"moe": {"top_k": 2}}}, "top_k differs"),
}


@pytest.mark.parametrize("name", sorted(MERGE_MISMATCHES))
@pytest.mark.parametrize("form", ["collection", "state_dict"])
def test_mismatched_merge_is_refused_and_changes_nothing(name, form):
    kwargs, message = MERGE_MISMATCHES[name]
    own, other = OPBCCollection(), OPBCCollection(**kwargs)
    own.update(make_batch(seed=1))
    other.update(make_batch(seed=2))
    own_values = own.compute()
    before = _states(own)
    with pytest.raises(ValueError, match=message):
        own.merge_state(other if form == "collection" else other.state_dict())
    _same_states(before, _states(own))
    assert own.compute().keys() == own_values.keys()
    with pytest.raises(ValueError, match=message):  # and the other way round
        other.load_state_dict(before)


def _without(state, drop):
    return {k: v for k, v in state.items() if not drop(k)}


CORRUPTIONS = {  # name: (the source's state dict -> a corrupt one, the error's message)
    "empty": (lambda state: {}, "empty"),
    "partial": (lambda state: _without(state, lambda k: k.startswith("SequenceESS.")), "SequenceESS"),
    "missing_state": (lambda state: _without(state, lambda k: k == "SequenceESS.count"),
                      r"SequenceESS\.count is missing"),
    "extra_key": (lambda state: {**state, "Nobody.count": torch.zeros((), dtype=torch.float64)}, "Nobody.count"),
    "wrong_shape": (lambda state: {**state, "ImportanceSamplingESS.count": torch.zeros(2, dtype=torch.float64)},
                    r"ImportanceSamplingESS\.count has shape \(2,\)"),
    "float32": (lambda state: {**state, "ImportanceSamplingESS.count": state["ImportanceSamplingESS.count"].float()},
                r"ImportanceSamplingESS\.count has dtype torch\.float32"),
    # an older or foreign checkpoint: no configuration
    "foreign": (lambda state: _without(state, lambda k: k.endswith("._extra_state")), "no opbc-metrics configuration"),
    "bad_extra_state": (lambda state: {**state, "ImportanceSamplingESS._extra_state": "{not json"},
                        "no opbc-metrics configuration"),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_and_changes_nothing(how):
    source = OPBCCollection()
    source.update(make_batch(seed=1))
    target = OPBCCollection()
    target.update(make_batch(seed=2))
    before = _states(target)
    corrupt, message = CORRUPTIONS[how]
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(corrupt(source.state_dict()))
    _same_states(before, _states(target))
    if how not in ("empty", "partial", "foreign"):
        with pytest.raises(ValueError, match=message):
            target.merge_state(corrupt(source.state_dict()))
        _same_states(before, _states(target))


def test_partial_load_is_refused():
    metrics = OPBCCollection()
    with pytest.raises(ValueError, match="strict=False"):
        metrics.load_state_dict(metrics.state_dict(), strict=False)


def test_standalone_metric_checks():
    m = ImportanceSamplingESS()
    m.update(make_batch(seed=1))
    before = m.state_dict()
    with pytest.raises(ValueError, match="clamp differs"):
        m.merge_state(ImportanceSamplingESS(clamp=5.0))
    with pytest.raises(ValueError, match=r"has dtype torch\.float32"):
        m.merge_state({name: torch.tensor(1.0) for name in m._defaults})  # float32 states
    with pytest.raises(ValueError, match="no opbc-metrics configuration"):
        m.load_state_dict({k: v for k, v in before.items() if k != "_extra_state"})
    with pytest.raises(ValueError, match="clamp differs"):
        ImportanceSamplingESS(clamp=5.0).load_state_dict(before)
    assert all(torch.equal(m.state_dict()[name], before[name]) for name in m._defaults)
    fresh = ImportanceSamplingESS()
    fresh.load_state_dict(before)
    assert fresh.compute() == m.compute()


def test_checkpoint_round_trips_through_torch_save_weights_only():
    metrics = OPBCCollection(sections=ALL_SECTIONS)
    metrics.update(make_batch(seed=3))
    buffer = io.BytesIO()
    torch.save(metrics.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    restored = OPBCCollection(sections=ALL_SECTIONS)
    restored.load_state_dict(loaded)
    torch.testing.assert_close(restored.compute(), metrics.compute(), rtol=0, atol=0)  # same keys, same values


# -- inputs that require grad --------------------------------------------------------------------
def test_forward_with_inputs_that_require_grad_keeps_no_graph():
    batch = make_batch(batch=3, seq=6, seed=4)
    trainer = batch["trainer_logprobs"].clone().requires_grad_(True)
    metrics = OPBCCollection()
    out = metrics({**batch, "trainer_logprobs": trainer})
    assert out and all(not v.requires_grad and v.grad_fn is None for v in out.values())
    metrics.update({**batch, "trainer_logprobs": trainer})
    assert all(not v.requires_grad for v in metrics.compute().values())
    assert all(not t.requires_grad for t in metrics.state_dict().values() if isinstance(t, torch.Tensor))
    single = ImportanceSamplingESS()
    value = single({**batch, "trainer_logprobs": trainer})
    assert not value.requires_grad


# -- bad input -----------------------------------------------------------------------------------
def test_probabilities_passed_as_logprobs_are_refused_at_compute():
    batch = make_batch(batch=3, seq=6, seed=5)
    probs = {**batch, "trainer_logprobs": batch["trainer_logprobs"].exp(),
             "rollout_logprobs": batch["rollout_logprobs"].exp()}
    metrics = OPBCCollection()
    with assert_no_host_sync():
        metrics.update(probs)
    with pytest.raises(ValueError, match=r"`trainer_logprobs` holds values in \[0, 1\] only.*probabilities"):
        metrics.compute()
    one_side = OPBCCollection()  # the rollout side alone passed as probabilities
    one_side.update({**batch, "rollout_logprobs": batch["rollout_logprobs"].exp()})
    with pytest.raises(ValueError, match=r"`rollout_logprobs` holds values in \[0, 1\] only"):
        one_side.compute()
    rounding = OPBCCollection()  # a logprob a hair above 0 is rounding, not probabilities
    b = make_batch(batch=3, seq=6, seed=5)
    b["trainer_logprobs"][0, 0] = 1e-6
    rounding.update(b)
    assert "opbc/is/ess" in rounding.compute()


@pytest.mark.parametrize("side", ["trainer_logprobs", "rollout_logprobs"])
def test_positive_logprobs_such_as_logits_are_refused_at_compute(side: str):
    batch = make_batch(batch=3, seq=300, seed=5)
    logits = batch[side] + 6.0  # mostly positive, some not: neither logprobs nor probabilities
    metrics = OPBCCollection()
    with assert_no_host_sync():
        metrics.update({**batch, side: logits})
    with pytest.raises(ValueError, match=rf"`{side}` holds positive values \(up to .*\): log-probabilities are <= 0"):
        metrics.compute()
    sentinel = OPBCCollection()  # a positive sentinel on a row short enough to be read whole
    b = make_batch(batch=3, seq=6, seed=5)
    b[side][0, 0] = 1e4
    sentinel.update(b)
    with pytest.raises(ValueError, match=rf"`{side}` holds positive values \(up to 10000\)"):
        sentinel.compute()


@pytest.mark.parametrize("seq", [127, 128, 4096, 8193])
def test_probabilities_in_long_rows_are_found(seq: int):
    """Probabilities are found with a response mask that leaves most columns out, and real logprobs are still
    accepted."""
    batch = make_batch(batch=2, seq=seq, seed=6)
    batch["response_mask"] = torch.zeros(2, seq, dtype=torch.bool)
    batch["response_mask"][1, seq // 3 :] = True
    probs = OPBCCollection(sections=("mismatch",))
    probs.update({**batch, "trainer_logprobs": batch["trainer_logprobs"].exp()})
    with pytest.raises(ValueError, match=r"`trainer_logprobs` holds values in \[0, 1\] only"):
        probs.compute()
    real = OPBCCollection(sections=("mismatch",))
    real.update(batch)
    assert "opbc/is/ess" in real.compute()


SHORT_RESPONSES = [(4, 4096, (1, 40)), (4, 4096, (100, 110)), (1, 4096, (1, 40)), (1, 4096, (4090, 4096))]
# A check on a sample of the columns missed these (60 tokens at 3000..3059 of two 8192-token rows; one token): the
# eager kernel finds them in its sweep, the compiled one counts them in its histogram (see batch_statistics).
MID_ROW_RESPONSES = [(2, 8192, (3000, 3060)), (1, 8192, (5000, 5001))]
# The compiled kernel's count gives no size: the error does not say "probabilities" where the sample saw none.
COUNTED = r"`rollout_logprobs` holds positive values on response tokens: log-probabilities are <= 0"


@pytest.mark.parametrize(
    ("rows", "seq", "columns", "compiled"),
    [(*case, compiled) for case in SHORT_RESPONSES + MID_ROW_RESPONSES for compiled in (False, True)],
)
def test_probabilities_on_a_few_columns_of_a_long_padded_batch_are_found(rows, seq, columns, compiled):
    """Short responses in a long padded batch: at its ends (each row samples from an offset of its own, and its first
    and last 16 columns) and anywhere, down to one token in the middle of a row."""
    batch = make_batch(batch=rows, seq=seq, seed=6)
    batch["response_mask"] = torch.zeros(rows, seq, dtype=torch.bool)
    batch["response_mask"][:, columns[0] : columns[1]] = True
    probs = OPBCCollection(compiled=compiled)
    probs.update({**batch, "rollout_logprobs": batch["rollout_logprobs"].exp()})
    sampled = r"`rollout_logprobs` holds values in \[0, 1\] only \(0 to"
    counted = compiled and (rows, seq, columns) in MID_ROW_RESPONSES
    with pytest.raises(ValueError, match=COUNTED if counted else sampled):
        probs.compute()


@pytest.mark.parametrize("side", ["trainer_logprobs", "rollout_logprobs"])
def test_the_compiled_kernel_counts_positive_logprobs_outside_the_column_sample(side):
    """One positive logprob in the middle of a long row, on a column the sample does not read: the compiled kernel's
    extra histogram copies count it, per side, and the histogram itself is the eager kernel's."""
    from opbc_metrics.functional import mismatch as fm

    batch = make_batch(batch=3, seq=8192, seed=4)
    values = batch[side].clone()
    values[1, 3001] = 0.5  # row 1 samples the columns 37 + 128 k: 2981 and 3109 around it
    values[2, 7] = 4.0  # a masked-out token (row 2's mask starts later): not counted
    batch["response_mask"][2, :8] = False
    batch["response_mask"][1, 3001] = True
    view = BatchView(**{**batch, side: values})
    assert max(view.logprob_sample[1].tolist()) <= fm.PROBABILITY_TOLERANCE  # the sample misses it
    args = (*view.token_inputs, 20.0, 30.0, 8192)
    compiled = fm.compiled_token_statistics()(*args)
    eager = fm.token_statistics(*args)
    expected = [1.0, 0.0] if side == "trainer_logprobs" else [0.0, 1.0]
    assert compiled[fm.LOGPROB_POSITIVE].tolist() == expected
    torch.testing.assert_close(compiled["hist"], eager["hist"], rtol=0, atol=0)
    metrics = OPBCCollection(compiled=True)  # (no assert_no_host_sync: dynamo does not run under its dispatch mode)
    metrics.update({**batch, side: values})
    with pytest.raises(ValueError, match=rf"`{side}` holds positive values on response tokens"):
        metrics.compute()
    clean = OPBCCollection(compiled=True)  # the same batch with its real logprobs passes
    clean.update(batch)
    assert "opbc/is/ess" in clean.compute()


@pytest.mark.parametrize("make", [OPBCCollection, ImportanceSamplingESS, PerRoundMismatch], ids=lambda m: m.__name__)
def test_one_positive_logprob_among_a_million_is_found_in_the_kernels_sweep(make, monkeypatch):
    """The largest logprobs come from the eager mismatch kernel's own sweep over every token (no pass of its own), in
    a collection and in a metric alone."""
    batch = make_batch(batch=128, seq=8192, seed=3)
    trainer = batch["trainer_logprobs"].clone()
    row, column = batch["response_mask"].nonzero()[123_456].tolist()
    trainer[row, column] = 2.5  # one logit-like value, on a response token
    own_pass = BatchView.logprob_high_pass
    monkeypatch.setattr(BatchView, "logprob_high_pass", lambda self: pytest.fail("a pass of its own"))
    metric = make()
    with assert_no_host_sync():
        metric.update({**batch, "trainer_logprobs": trainer})
    with pytest.raises(ValueError, match=r"`trainer_logprobs` holds positive values \(up to 2.5\)"):
        metric.compute()
    monkeypatch.setattr(BatchView, "logprob_high_pass", own_pass)
    view = BatchView(**{**batch, "trainer_logprobs": trainer})  # no kernel: the view's own pass, the same maxima
    valid = batch["response_mask"].bool()
    zero = [0.0] if not valid.all() else []  # 0 stands in for the masked tokens
    assert view.logprob_high.tolist() == [max(trainer[valid].tolist() + zero),
                                          max(batch["rollout_logprobs"][valid].tolist() + zero)]


@pytest.mark.parametrize(
    ("field", "schema", "adapter"),
    [("completion_mask", "response_mask", "trl_to_batch"), ("old_per_token_logps", "trainer_logprobs", "trl_to_batch"),
     ("sampling_per_token_logps", "rollout_logprobs", "trl_to_batch"),
     ("attention_mask", "response_mask", "verl_to_batch"), ("old_log_probs", "trainer_logprobs", "verl_to_batch"),
     ("rollout_log_probs", "rollout_logprobs", "verl_to_batch")],
)
def test_framework_field_names_are_refused(field, schema, adapter):
    import opbc_metrics.integrations.trl as trl
    import opbc_metrics.integrations.verl as verl

    assert hasattr(trl, "trl_to_batch") and hasattr(verl, "verl_to_batch")  # the advice names real functions
    batch = make_batch(batch=2, seq=4, seed=6)
    batch[field] = batch.pop(schema)
    with pytest.raises(ValueError, match=rf"`{field}` is not read.*`{schema}`.*{adapter}"):
        OPBCCollection().update(batch)


@pytest.mark.parametrize(("field", "meant"), [("respons_mask", "response_mask"), ("response_masks", "response_mask"),
                                             ("reward", "rewards"), ("group_id", "group_ids"),
                                             ("rollout_logprob", "rollout_logprobs")])
def test_a_misspelt_field_is_refused_before_any_state_moves(field: str, meant: str):
    batch = {**make_batch(batch=4, seq=5, seed=7), "rewards": torch.ones(4)}
    batch[field] = batch.pop(meant)
    # (ESS reads no rewards or groups: there a misspelt `reward` changes nothing, and is ignored with a warning)
    alone = [ImportanceSamplingESS()] if meant in ("response_mask", "rollout_logprobs") else []
    for metrics in (OPBCCollection(sections=ALL_SECTIONS), *alone):
        before = {k: v.clone() for k, v in metrics.state_dict().items() if isinstance(v, torch.Tensor)}
        # (a required field is named as missing first, with the field that looks like it)
        with pytest.raises(ValueError, match=rf"`{field}` is not read by opbc-metrics: did you mean `{meant}`"
                                             rf"|`{meant}` is required but missing.*given as `{field}`\?"):
            metrics.update(batch)
        after = metrics.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())  # refused before the fold
    with pytest.raises(ValueError, match=rf"`{field}` is not read|given as `{field}`"):
        OPBCCollection(sections=ALL_SECTIONS)(batch)  # forward too


def test_a_field_no_metric_reads_is_ignored_with_a_warning_naming_it():
    batch = make_batch(batch=4, seq=5, seed=7)
    with pytest.warns(UserWarning, match=r"`input_ids` not read by opbc-metrics: ignored"):
        OPBCCollection().update({**batch, "input_ids": torch.ones(4, 5)})
    # fields of other sections (rewards: the rollout section) are reported once, naming the section that reads them
    with pytest.warns(UserWarning, match=r"`rewards` \(read by the rollout and training sections\).*"
                                         r'sections=\[\.\.\., "rollout"\]'):
        OPBCCollection().update({**batch, "rewards": torch.ones(4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a collection that reads them: no warning
        OPBCCollection(sections=["mismatch", "rollout"]).update({**batch, "rewards": torch.ones(4)})
    # a name near one that a metric of another section reads is a field of the user's own, not a misspelling
    with pytest.warns(UserWarning, match=r"`grad_norm` not read"):
        OPBCCollection(sections=ALL_SECTIONS).update({**batch, "grad_norm": torch.tensor(1.0)})


def test_mask_values_other_than_0_and_1_are_refused_at_compute():
    batch = make_batch(batch=4, seq=5, seed=7)
    for bad in (2, -100, 0.5, float("nan")):
        mask = batch["response_mask"].to(torch.float64)
        mask[0, 0], mask[1, 0] = bad, bad
        metrics = OPBCCollection()
        with assert_no_host_sync():
            metrics.update({**batch, "response_mask": mask})
        with pytest.raises(ValueError, match=r"`response_mask` held 2 value\(s\) other than 0 and 1"):
            metrics.compute()
    for fine in (batch["response_mask"], batch["response_mask"].float(), batch["response_mask"].bool()):
        metrics = OPBCCollection()
        metrics.update({**batch, "response_mask": fine})
        assert "opbc/is/ess" in metrics.compute()


def test_a_tensor_or_a_verl_data_proto_as_the_batch_gets_a_hint():
    with pytest.raises(TypeError, match="got a Tensor: pass the fields by name"):
        OPBCCollection().update(torch.zeros(2, 3))

    class DataProto:  # the attributes of verl's DataProto
        def __init__(self):
            self.batch, self.non_tensor_batch, self.meta_info = {}, {}, {}

    with pytest.raises(ValueError, match=r"`trainer_logprobs` is required but missing.*verl_to_batch"):
        ImportanceSamplingESS().update(DataProto())


@pytest.mark.parametrize("field", ["rewards", "group_ids", "advantages", "response_lengths"])
def test_per_sequence_field_of_the_wrong_length_is_refused(field):
    batch = make_batch(batch=4, seq=5, seed=7)
    batch[field] = torch.ones(5)
    with pytest.raises(ValueError, match=rf"`{field}` has 5 entries but the batch has 4 sequences"):
        OPBCCollection(sections=ALL_SECTIONS).update(batch)


# -- torchmetrics conventions --------------------------------------------------------------------
def test_prefix_postfix_and_indexing_by_key():
    batch = make_batch(seed=9)
    plain = OPBCCollection()
    named = OPBCCollection(prefix="bf16/", postfix="_x")
    plain.update(batch)
    fwd = named(batch)
    out = named.compute()
    assert set(out) == {f"bf16/{k}_x" for k in plain.compute()}
    assert set(fwd) == set(out)
    assert torch.equal(out["bf16/opbc/is/ess_x"], plain.compute()["opbc/is/ess"])
    assert plain["opbc/is/ess"] is plain["ImportanceSamplingESS"]
    assert named["bf16/opbc/is/ess_x"] is named["ImportanceSamplingESS"]
    assert plain["opbc/kl/k3"] is plain["KLEstimators"]
    with pytest.raises(KeyError, match="neither a member name nor a key"):
        plain["opbc/is/nothing"]


def test_plot_every_scalar_metric_and_the_collection():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = OPBCCollection()
    values = [metrics(make_batch(seed=s)) for s in range(3)]
    plotted = 0
    for m in metrics.members():
        if len(m.keys) == 1 and m.compute_dict():
            fig, ax = m.plot()
            assert fig is not None and ax.has_data()
            plt.close(fig)
            fig, ax = m.plot([v[m.keys[0]] for v in values])
            assert ax.has_data()
            plt.close(fig)
            plotted += 1
    assert plotted >= 7
    fig, ax = metrics.plot()
    assert ax.has_data()
    fig, ax = metrics.plot(values)
    assert ax.has_data()
    separate = metrics.plot(together=False)
    assert len(separate) == sum(1 for m in metrics.members() if m.compute_dict())
    plt.close("all")


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    import torchmetrics.utilities.imports as imports

    monkeypatch.setattr(imports, "_MATPLOTLIB_AVAILABLE", False)
    metric = ImportanceSamplingESS()
    metric.update(make_batch(seed=1))
    with pytest.raises(ImportError, match="pip install matplotlib"):
        metric.plot()
