"""Endpoint-capability probe and coverage metrics: real-format fixtures with hand-written expectations,
an independent plain-Python reference on generated responses, properties and bad input (the shared
contracts are in test_contracts.py)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given

from opbc_metrics import OPBCCollection
from opbc_metrics import endpoint as E
from opbc_metrics.functional import endpoint as FE
from tests.data import exchange_lists, split_exchanges
from tests.reference import ENDPOINT_KEYS, FLAGS, endpoint_reference, ref_flags

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "endpoint"
FIXTURES = sorted(FIXTURE_DIR.glob("*.json"))


def load(path):
    return json.loads(Path(path).with_suffix(".json").read_text())


def assert_window(out, expected, keys=ENDPOINT_KEYS):
    assert set(out) == set(keys)
    for key in keys:
        assert out[key].dtype == torch.float64
        got = out[key].item()
        assert math.isclose(got, expected[key], rel_tol=1e-12, abs_tol=1e-15), (key, got, expected[key])


# --- fixtures in the real formats ------------------------------------------------------------------
def test_fixtures_cover_each_format():
    names = {p.stem for p in FIXTURES}
    assert {"openai_chat_logprobs", "openai_completions_legacy_logprobs", "openai_chat_no_logprobs",
            "vllm_chat_token_ids", "vllm_completions_token_ids"} <= names
    assert (FIXTURE_DIR / "README.md").exists()


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_probe_reads_fixture(path):
    data = load(path)
    assert "OpenAI API reference" in data["_comment"] or "vLLM docs" in data["_comment"]
    caps = E.probe_response(data["response"], data["request"])
    assert caps.api == data["expected"]["api"]
    assert caps.flags() == {f: data["expected"][f] for f in FLAGS}
    # The reference agrees with the hand-written expectations too.
    assert ref_flags(data["response"], data["request"]) == {f: data["expected"][f] for f in FLAGS}
    # Without the request, no seed counts as requested.
    assert not E.probe_response(data["response"]).seed_supported


def test_coverage_over_fixtures():
    data = [load(p) for p in FIXTURES]
    m = OPBCCollection(sections=["endpoint"])
    m.update(endpoint_responses=[d["response"] for d in data], endpoint_requests=[d["request"] for d in data])
    out = m.compute()
    for flag in FLAGS:
        share = sum(d["expected"][flag] for d in data) / len(data)
        assert out[f"endpoint/capabilities/{flag}"].item() == pytest.approx(share, rel=1e-12), flag
    assert out["endpoint/capabilities/num_responses"].item() == len(data)


def test_hand_computed_coverage():
    vllm_chat = load(FIXTURE_DIR / "vllm_chat_token_ids")
    openai_chat = load(FIXTURE_DIR / "openai_chat_logprobs")
    m = OPBCCollection(sections=["endpoint"])
    # vLLM: ids yes, seed no (null fingerprint); OpenAI: ids no, seed yes. Two of each plus one OpenAI.
    m.update(endpoint_responses=[vllm_chat["response"]] * 2, endpoint_requests=vllm_chat["request"])
    m.update(endpoint_responses=[openai_chat["response"]] * 3, endpoint_requests=openai_chat["request"])
    out = {k: v.item() for k, v in m.compute().items()}
    assert out["endpoint/capabilities/token_ids_available"] == pytest.approx(2 / 5)
    assert out["endpoint/capabilities/seed_supported"] == pytest.approx(3 / 5)
    assert out["endpoint/capabilities/seed_requested"] == 1.0
    assert out["endpoint/capabilities/sampled_logprobs_available"] == 1.0
    assert out["endpoint/capabilities/num_responses"] == 5.0


def test_client_objects_with_model_dump():
    data = load(FIXTURE_DIR / "vllm_chat_token_ids")
    response, request = (SimpleNamespace(model_dump=lambda d=data[k]: copy.deepcopy(d))
                         for k in ("response", "request"))
    caps = E.probe_response(response, request)  # OpenAI client objects (pydantic) expose model_dump()
    assert caps.flags() == {f: data["expected"][f] for f in FLAGS}


def test_top_logprobs_need_alternatives_at_every_position():
    item = {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}
    bare = {"token": "b", "logprob": -0.2, "top_logprobs": []}
    assert E.probe_response(_chat(logprobs={"content": [item, item]})).top_logprobs_available
    assert not E.probe_response(_chat(logprobs={"content": [item, bare]})).top_logprobs_available
    assert E.probe_response(_completion(top_logprobs=[{"x": -0.1}], token_logprobs=[-0.1])).top_logprobs_available
    two = _completion(tokens=["x", "y"], token_logprobs=[None, -0.1], top_logprobs=[None, {"y": -0.1}],
                      text_offset=[0, 1])
    assert E.probe_response(two).top_logprobs_available  # a null entry (echoed first token) is allowed
    two["choices"][0]["logprobs"]["top_logprobs"] = [{"x": -0.3}, {}]
    assert not E.probe_response(two).top_logprobs_available
    three = _completion(tokens=["x", "y", "z"], token_logprobs=[-0.1, -0.2, -0.3],
                        top_logprobs=[{"x": -0.1}, None, {"z": -0.3}], text_offset=[0, 1, 2])
    assert not E.probe_response(three).top_logprobs_available  # a null entry at a sampled position


def test_multiple_choices_need_the_capability_in_every_choice():
    data = load(FIXTURE_DIR / "vllm_completions_token_ids")
    resp = copy.deepcopy(data["response"])
    second = copy.deepcopy(resp["choices"][0])
    second.update(index=1, token_ids=None, logprobs=None)
    resp["choices"].append(second)
    caps = E.probe_response(resp)
    assert not caps.token_ids_available and not caps.sampled_logprobs_available
    assert caps.prompt_token_ids_available


# --- against the reference on generated responses --------------------------------------------------
@given(exchange_lists())
@example([])  # no response: no value (a ValueError)
def test_probe_and_window_match_reference(exchanges):
    for resp, req in exchanges:
        assert E.probe_response(resp, req).flags() == ref_flags(resp, req)
    if not exchanges:
        with pytest.raises(ValueError, match=r"endpoint_capabilities\(\): no response in the batch"):
            FE.endpoint_capabilities(*split_exchanges(exchanges))
        return
    out = FE.endpoint_capabilities(*split_exchanges(exchanges))
    assert_window(out, endpoint_reference(exchanges))
    for flag in FLAGS:  # bounds
        assert 0.0 <= out[f"endpoint/capabilities/{flag}"].item() <= 1.0
    assert out["endpoint/capabilities/seed_supported"] <= out["endpoint/capabilities/seed_requested"]


# --- contracts -------------------------------------------------------------------------------------
def test_requests_one_body_for_all_or_none():
    responses = [load(p)["response"] for p in FIXTURES]
    one = FE.endpoint_capabilities(responses, {"seed": 5})
    fingerprinted = sum(bool(r.get("system_fingerprint")) for r in responses) / len(responses)
    assert one["endpoint/capabilities/seed_supported"].item() == pytest.approx(fingerprinted)
    none = FE.endpoint_capabilities(responses)
    assert none["endpoint/capabilities/seed_requested"].item() == 0.0


def _chat(**choice):
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                      **choice}]}


def _completion(**logprobs):
    base = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": None, "text_offset": [0]}
    base.update(logprobs)
    return {"object": "text_completion", "choices": [{"index": 0, "text": "x", "logprobs": base}]}


@pytest.mark.parametrize(
    "responses, requests, field",
    [
        ({"choices": []}, None, "endpoint_responses"),
        (["not json"], None, r"endpoint_responses\[0\].*`response`"),
        ([{"object": "chat.completion"}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": []}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": {"0": {}}}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": [{"index": 0}]}], None, r"choices\[0\]\.message"),
        ([{"object": "text_completion", "choices": [{"index": 0}]}], None, r"choices\[0\]\.text"),
        ([{"choices": [{"index": 0}]}], None, r"choices\[0\]\.message"),
        ([{"object": "chat.completion.chunk", "choices": [{"delta": {}}]}], None, "`object`"),
        ([_chat(logprobs={"content": [{"token": "x"}]})], None, r"choices\[0\]\.logprobs\.content\[0\]\.logprob"),
        ([_chat(logprobs={"content": [{"logprob": -1.0}]})], None, r"content\[0\]\.token"),
        ([_chat(logprobs={"content": "x"})], None, r"logprobs\.content"),
        ([_chat(logprobs={"content": [{"token": "x", "logprob": -1, "top_logprobs": [{"token": "y"}]}]})], None,
         r"top_logprobs\[0\]\.logprob"),
        ([_chat(token_ids=["1"])], None, r"choices\[0\]\.token_ids"),
        ([_chat(token_ids=[True])], None, r"choices\[0\]\.token_ids"),
        ([dict(_chat(), prompt_token_ids="1 2 3")], None, "prompt_token_ids"),
        ([dict(_chat(), system_fingerprint=5)], None, "system_fingerprint"),
        ([_completion(token_logprobs=None)], None, r"logprobs\.token_logprobs"),
        ([_completion(tokens=None)], None, r"logprobs\.tokens"),
        ([_completion(token_logprobs=[-0.1, -0.2])], None, r"logprobs\.token_logprobs"),
        ([_completion(token_logprobs=["-0.1"])], None, r"token_logprobs\[0\]"),
        ([_completion(top_logprobs=[{"x": "high"}])], None, r"top_logprobs\[0\]"),
        ([_chat()], [{"seed": "7"}], "seed"),
        ([_chat()], [{"seed": 1}, {"seed": 2}], "endpoint_requests"),
        ([_chat()], 5, "endpoint_requests"),
        ([_chat()], ["not a request"], "request"),
    ],
)
def test_bad_input_names_the_field(responses, requests, field):
    for metric in (E.TokenIdsCoverage(), OPBCCollection(sections=["endpoint"])):
        with pytest.raises(ValueError, match=field):
            metric.update(endpoint_responses=responses, endpoint_requests=requests)



def test_requests_without_their_responses_are_refused_in_a_collection():
    """Requests alone used to be skipped silently by the default collection (the section needs the responses)."""
    from opbc_metrics import OPBCCollection

    with pytest.raises(ValueError, match="`endpoint_responses` is required but missing"):
        OPBCCollection(sections=["endpoint"]).update(endpoint_requests=[{"model": "m", "seed": 1}])
