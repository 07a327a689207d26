"""Agent-trajectory metrics against an independent plain-Python reference, by hand, properties and bad input
(the shared contracts are in test_contracts.py).

The reference (tests/reference.py) works on the raw OpenAI-style message lists (dicts), never on the library's data
model: it re-derives steps, canonical arguments, divergence and the window values from the definitions
in DESIGN.md / the source glossary.
"""

from __future__ import annotations

import copy
import hashlib
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from opbc_metrics import agent as A
from opbc_metrics.functional import agent as FA
from opbc_metrics.metric import NoDataError
from tests.data import message_lists, pair_lists, random_pairs
from tests.reference import AGENT_KEYS, KINDS, agent_reference, ref_norm, ref_pair, ref_parse


def assert_window(out, expected, rel=1e-12):
    """``out`` has exactly the reference's keys (a key without a value is left out by both), each close."""
    assert set(out) == set(expected) and set(out) <= set(AGENT_KEYS), set(out) ^ set(expected)
    for key in expected:
        assert out[key].dtype == torch.float64
        assert math.isclose(out[key].item(), expected[key], rel_tol=rel, abs_tol=1e-15), (key, out[key], expected[key])


# --- against the reference -------------------------------------------------------------------------
@given(pair_lists())
@example([])  # no pair: no value (a ValueError)
def test_functional_matches_reference_and_bounds(pairs):
    if not pairs:
        with pytest.raises(ValueError, match=r"agent_metrics\(\): no trajectory pair in the batch"):
            FA.agent_metrics(pairs)
        return
    window = FA.agent_metrics(pairs)
    assert_window(window, agent_reference(pairs))
    for a, b in pairs:
        jac, div, match, disagree, either, soft, _, _ = ref_pair(a, b)
        assert FA.tool_call_jaccard(a, b) == pytest.approx(jac, rel=1e-15)
        assert FA.first_divergence(a, b) == (None if div is None else FA.Divergence(*div))
        assert FA.answer_match(a, b) is match
        assert FA.tool_choice_disagreement(a, b) == (disagree, either)
        assert FA.answer_soft_match(a, b) == pytest.approx(soft, rel=1e-15)
    out = {k: v.item() for k, v in window.items()}
    for key in ("agent/trajectory/tool_call_jaccard", "agent/trajectory/diverged_fraction", "agent/answer/match_rate",
                "agent/answer/soft_match_mean", "agent/steps/tool_choice_disagreement_rate"):
        assert 0.0 <= out.get(key, 0.0) <= 1.0, key
    kinds = sum(out[f"agent/trajectory/divergence_kind/{k}"] for k in KINDS)
    assert kinds == pytest.approx(out["agent/trajectory/diverged_fraction"], abs=1e-12)
    assert ("agent/trajectory/first_divergence_step_mean" in out) == (out["agent/trajectory/diverged_fraction"] > 0)
    if out["agent/trajectory/diverged_fraction"] > 0:
        lo, mean = out["agent/trajectory/first_divergence_step_min"], out["agent/trajectory/first_divergence_step_mean"]
        assert 0 <= lo <= mean


def test_hand_computed_window():
    search_x = {"type": "function", "function": {"name": "search", "arguments": '{"q": "x", "k": 2}'}}
    search_x_reordered = {"type": "function", "function": {"name": "search", "arguments": '{"k":2,"q":"x"}'}}
    calc = {"type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
    a = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [search_x]},
         {"role": "tool", "content": "r"}, {"role": "assistant", "content": "Two"}]
    b = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [search_x_reordered]},
         {"role": "tool", "content": "r"}, {"role": "assistant", "content": None, "tool_calls": [calc]},
         {"role": "tool", "content": "2"}, {"role": "assistant", "content": "two "}]
    # (a, b): same first step (argument order is canonicalised); step 1: [] vs [calc] -> tool_choice at 1;
    # sets {search} vs {search, calc}: J = 1/2; answers "two" == "two"; tool steps: 0 agree, 1 differs, 2 none.
    # (a, a): identical. (b, a): as (a, b), mirrored.
    m = OPBCCollection(sections=["agent"])
    m.update(trajectory_pairs=[(a, b), (a, a), (b, a)])
    out = {k: v.item() for k, v in m.compute().items()}
    assert out["agent/trajectory/tool_call_jaccard"] == pytest.approx((0.5 + 1 + 0.5) / 3)
    assert out["agent/trajectory/first_divergence_step_mean"] == 1.0
    assert out["agent/trajectory/first_divergence_step_min"] == 1.0
    assert out["agent/trajectory/diverged_fraction"] == pytest.approx(2 / 3)
    assert out["agent/trajectory/divergence_kind/tool_choice"] == pytest.approx(2 / 3)
    assert out["agent/trajectory/divergence_kind/length"] == 0.0
    assert out["agent/answer/match_rate"] == 1.0
    assert out["agent/steps/tool_choice_disagreement_rate"] == pytest.approx(2 / 5)  # 1+0+1 of 2+1+2
    assert out["agent/trajectory/num_pairs"] == 3.0


def traj(*steps):
    return A.Trajectory([A.Step(c, calls) for c, calls in steps])


def test_divergence_kinds_in_order_of_precedence():
    base = traj(("a", [("f", '{"x": 1}')]), ("done", []))
    assert FA.first_divergence(base, traj(("a", [("g", '{"x": 1}')]), ("done", []))) == (0, "tool_choice")
    # Different tool AND different content: tool choice wins.
    assert FA.first_divergence(base, traj(("zzz", [("g", "{}")]), ("done", []))).kind == "tool_choice"
    assert FA.first_divergence(base, traj(("zzz", [("f", '{"x": 2}')]), ("done", []))).kind == "tool_arguments"
    assert FA.first_divergence(base, traj(("A ", [("f", '{"x":1}')]), ("other", []))) == (1, "content")
    assert FA.first_divergence(base, traj(("a", [("f", '{"x": 1}')]))) == (1, "length")
    assert FA.first_divergence(base, traj(("a", [("f", '{"x": 1}')]), ("DONE", []), ("more", []))) == (2, "length")
    # Tool lists are ordered: swapped parallel calls are a different choice.
    two = traj(("", [("f", "{}"), ("g", "{}")]))
    assert FA.first_divergence(two, traj(("", [("g", "{}"), ("f", "{}")]))) == (0, "tool_choice")
    assert FA.tool_call_jaccard(two, traj(("", [("g", "{}"), ("f", "{}")]))) == 1.0


def test_text_beside_the_same_tool_calls_is_not_a_divergence():
    a = traj(("Let me search for it.", [("search", '{"q": "x"}')]), ("It is 4", []))
    b = traj(("I will look this up", [("search", '{ "q":"x" }')]), ("it is  4", []))
    assert FA.first_divergence(a, b) is None
    # Without tool calls the text is the action (the final answer).
    assert FA.first_divergence(a, traj(("whatever", [("search", '{"q": "x"}')]), ("It is 5", []))) == (1, "content")


def test_answer_match_and_soft_match_by_hand():
    def answered(text):
        return [{"role": "assistant", "content": text}]

    stopped = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert not FA.answer_match(stopped, stopped)  # both stopped at the step limit
    assert FA.answer_soft_match(stopped, stopped) == 0.0
    assert FA.answer_soft_match(answered("the answer is 42"), answered("42")) == pytest.approx(0.4)  # 2*1/(4+1)
    assert FA.answer_soft_match(answered("a a b"), answered("a b b")) == pytest.approx(2 / 3)  # overlap {a, b}
    assert FA.answer_soft_match(answered("Paris"), answered(" paris ")) == 1.0
    m = OPBCCollection(sections=["agent"])
    m.update(trajectory_pairs=[(answered("the answer is 42"), answered("42")), (stopped, stopped)])
    out = m.compute()
    assert out["agent/answer/match_rate"].item() == 0.0
    assert out["agent/answer/soft_match_mean"].item() == pytest.approx(0.2)
    assert out["agent/steps/rollout_mean"].item() == 1.0 and out["agent/steps/reference_mean"].item() == 1.0


# --- the data model --------------------------------------------------------------------------------
def test_canonical_arguments_and_stable_hash():
    a = A.ToolCall("search", '{"q": "cats", "k": 3}')
    b = A.ToolCall("search", {"k": 3, "q": "cats"})
    assert a == b and a.key == b.key
    canonical = '{"k":3,"q":"cats"}'
    assert a.arguments == canonical
    assert a.arguments_hash == hashlib.sha256(canonical.encode()).hexdigest()
    # Stable across processes: a fixed, known digest (sha256 of the two bytes "{}").
    assert A.ToolCall("f").arguments_hash == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    assert A.ToolCall("f", "") == A.ToolCall("f", None) == A.ToolCall("f", "{}") == A.ToolCall("f", {})
    assert A.ToolCall("f", '{"q": "é"}') == A.ToolCall("f", '{"q": "\\u00e9"}')
    assert A.ToolCall("f", "1") != A.ToolCall("f", "1.0")  # documented: numbers as parsed


def test_malformed_arguments_are_deterministic():
    a, b = A.ToolCall("f", '{"q": "x"'), A.ToolCall("f", '  {"q": "x"\n')
    assert a.malformed and b.malformed and a == b
    assert a.arguments == '{"q": "x"'
    assert a.arguments_hash == hashlib.sha256(b'{"q": "x"').hexdigest()
    assert a != A.ToolCall("f", '{"q": "x"}') and not A.ToolCall("f", '{"q": "x"}').malformed
    assert A.ToolCall("f", '{"q":"x"').key != a.key  # raw texts are compared as written (stripped)
    assert FA.tool_call_jaccard(A.Trajectory([A.Step(tool_calls=[a])]), A.Trajectory([A.Step(tool_calls=[b])])) == 1.0


def test_from_messages_reads_content_parts_function_call_and_skips_environment():
    traj = A.Trajectory.from_messages(
        [
            {"role": "developer", "content": "rules"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me "}, {"type": "text", "text": "check"}],
             "function_call": {"name": "lookup", "arguments": '{"id": 1}'}},
            {"role": "function", "name": "lookup", "content": "{}"},
            {"role": "assistant", "content": "Done", "reasoning_content": "ignored"},
        ],
        terminal_reason="stop",
    )
    assert [s.content for s in traj.steps] == ["Let me check", "Done"]
    assert traj.steps[0].tool_calls == (A.ToolCall("lookup", {"id": 1}),)
    assert traj.final_answer == "Done" and traj.terminal_reason == "stop"
    # Ending on a tool call: no final answer (compared as "").
    open_ended = A.Trajectory.from_messages([{"role": "assistant", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    assert open_ended.final_answer is None
    # Neither side answered: they did not reach the same answer.
    assert not FA.answer_match(open_ended, A.Trajectory([A.Step("")], final_answer="  "))
    # An explicit final answer wins.
    assert A.Trajectory.from_messages([{"role": "assistant", "content": "x"}], final_answer="y").final_answer == "y"


def test_client_objects_with_model_dump_are_accepted():
    # an OpenAI client object (pydantic) exposes model_dump()
    msgs = [SimpleNamespace(model_dump=lambda: {"role": "assistant", "content": "hi", "tool_calls": None})]
    assert A.Trajectory.from_messages(msgs).final_answer == "hi"


# --- properties ------------------------------------------------------------------------------------
@given(message_lists(), message_lists())
def test_jaccard_bounded_and_symmetric(a, b):
    j = FA.tool_call_jaccard(a, b)
    assert 0.0 <= j <= 1.0
    assert j == FA.tool_call_jaccard(b, a)
    assert FA.first_divergence(a, b) == FA.first_divergence(b, a)
    assert FA.answer_match(a, b) == FA.answer_match(b, a)
    assert FA.answer_soft_match(a, b) == pytest.approx(FA.answer_soft_match(b, a), rel=1e-15)
    assert FA.answer_match(a, b) <= (FA.answer_soft_match(a, b) == 1.0)
    assert FA.tool_choice_disagreement(a, b) == FA.tool_choice_disagreement(b, a)


@given(st.lists(message_lists(), min_size=1, max_size=5))
def test_identical_trajectories_agree_completely(trajs):
    out = FA.agent_metrics([(t, copy.deepcopy(t)) for t in trajs])
    assert out["agent/trajectory/tool_call_jaccard"] == 1.0
    assert out["agent/trajectory/diverged_fraction"] == 0.0
    assert "agent/trajectory/first_divergence_step_mean" not in out  # no pair diverged: no step (not -1)
    answered = [ref_norm(ref_parse(t)[1]) != "" for t in trajs]  # a trajectory without an answer matches none
    assert out["agent/answer/match_rate"] == pytest.approx(sum(answered) / len(trajs))
    assert out["agent/answer/soft_match_mean"] == pytest.approx(sum(answered) / len(trajs))
    tools = any(step.tool_calls for t in trajs for step in A.Trajectory.from_messages(t).steps)
    assert out.get("agent/steps/tool_choice_disagreement_rate") == (0.0 if tools else None)  # 0/0: no key
    assert out["agent/steps/rollout_mean"] == out["agent/steps/reference_mean"]
    for t in trajs:
        assert FA.first_divergence(t, t) is None


def test_keys_without_a_denominator_are_left_out_in_the_window():
    """The audit's case: pairs that never diverge and never call a tool give no divergence step (not -1) and no
    tool-choice rate (not 0/0 = 0); a later pair that diverges at a tool call brings both back."""
    quiet = A.Trajectory([A.Step("x"), A.Step("y")])
    metrics = OPBCCollection(sections=["agent"])
    metrics.update(trajectory_pairs=[(quiet, quiet)])
    out = metrics.compute()
    for key in ("agent/trajectory/first_divergence_step_mean", "agent/trajectory/first_divergence_step_min",
                "agent/steps/tool_choice_disagreement_rate"):
        assert key not in out, key
    assert out["agent/trajectory/diverged_fraction"].item() == 0.0 and out["agent/trajectory/num_pairs"].item() == 1
    with pytest.raises(NoDataError):
        one = A.ToolChoiceDisagreementRate()
        one.update(trajectory_pairs=[(quiet, quiet)])
        one.compute()
    tool = A.Trajectory([A.Step("x"), A.Step(tool_calls=[("search", "{}")])])
    metrics.update(trajectory_pairs=[(tool, quiet)])
    out = metrics.compute()
    assert out["agent/trajectory/first_divergence_step_min"].item() == 1.0
    assert out["agent/steps/tool_choice_disagreement_rate"].item() == 1.0


# --- contracts -------------------------------------------------------------------------------------
def test_states_are_float64():
    m = OPBCCollection(sections=["agent"])
    m.update(trajectory_pairs=random_pairs(0, 3))
    state = m.state_dict()
    assert all(v.dtype == torch.float64 for k, v in state.items() if not k.endswith("._extra_state"))


@pytest.mark.parametrize(
    "pairs, field",
    [
        ("not a list", "trajectory_pairs"),
        ({"rollout": []}, "trajectory_pairs"),
        ([([{"role": "assistant", "content": "a"}],)], r"trajectory_pairs\[0\]"),
        ([(1, 2, 3)], r"trajectory_pairs\[0\]"),
        ([([{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "a"}])],
         r"trajectory_pairs\[0\]\[0\]"),
        ([([], [{"role": "assistant", "content": "a"}])], r"trajectory_pairs\[0\]\[0\]"),
        ([([{"role": "assistant", "content": "a"}], "text")], r"trajectory_pairs\[0\]\[1\]"),
        ([([{"role": "assistant", "content": "a"}], [{"role": "robot", "content": "a"}])], r"messages\[0\]\.role"),
        ([([{"role": "assistant", "tool_calls": [{"type": "function"}]}], [{"role": "assistant"}])],
         r"tool_calls\[0\]\.function"),
        ([([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], [{"role": "assistant"}])],
         r"function\.name"),
        ([([{"role": "assistant", "content": 5}], [{"role": "assistant"}])], r"messages\[0\]\.content"),
        ([([{"role": "assistant", "tool_calls": "f()"}], [{"role": "assistant"}])], r"messages\[0\]\.tool_calls"),
        ([(["not a message"], [{"role": "assistant"}])], r"messages\[0\]"),
    ],
)
def test_bad_input_names_the_field(pairs, field):
    for metric in (A.FirstDivergenceStep(), OPBCCollection(sections=["agent"])):
        with pytest.raises(ValueError, match=field):
            metric.update(trajectory_pairs=pairs)


@pytest.mark.parametrize("make, match", [
    (lambda: A.Trajectory(()), "steps"),
    (lambda: A.Trajectory.from_messages([{"role": "user", "content": "hi"}]), "no assistant message"),
    (lambda: A.Trajectory(["not a step"]), r"steps\[0\]"),
    (lambda: A.Trajectory([A.Step("a")], final_answer=3), "final_answer"),
    (lambda: A.Step(content=3), "content"),
    (lambda: A.ToolCall(3, "{}"), "name"),
    (lambda: A.ToolCall("f", {"not": object()}), "arguments"),
    (lambda: FA.tool_call_jaccard("text", [{"role": "assistant"}]), "rollout"),
], ids=["no steps", "no assistant message", "not a step", "final_answer", "content", "name", "arguments", "pair"])
def test_trajectory_without_steps_and_wrong_types_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()

