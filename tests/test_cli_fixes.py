"""CLI and report regressions: lines that overflow, .jsonl files starting with '[', ``python -m opbc_metrics``,
non-torch .pt files, groups without an ESS, and ESS values that printed as "1"."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opbc_metrics.cli import main
from opbc_metrics.report import MISSING, fmt, render_html, worst_groups
from tests.support import GOOD_SAMPLE, ROOT, analyze_cli


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "key,value,fragment",
    [("response_length", 10**30, "`response_length` is too large (31 digits)"),
     ("prompt_length", 2**63, "`prompt_length` is too large"),
     ("reward", -(10**400), "`reward` is too large"),
     ("policy_lag", 10**400, "`policy_lag` is too large")],
)
def test_an_integer_too_large_is_an_issue_of_its_line(tmp_path, key, value, fragment):
    """It aborted the whole run ("unexpected ValueError: Overflow when unpacking long long")."""
    lines = [json.dumps(GOOD_SAMPLE)] * 3 + [json.dumps({**GOOD_SAMPLE, key: value})] + [json.dumps(GOOD_SAMPLE)] * 30
    status, result, err = analyze_cli(_write(tmp_path / "big.jsonl", lines), tmp_path / "out")
    assert status == 0, err
    assert f"big.jsonl line 4: {fragment}" in err, err
    assert result is not None and result["input"]["samples"] == 33 and result["input"]["issues_total"] == 1
    assert result["input"]["issues"][0]["line"] == 4


def test_a_jsonl_file_starting_with_a_bracket_is_read_line_by_line(tmp_path):
    """The file was read as one JSON array: every later line was lost ("extra data after the JSON array")."""
    for first in ("[1]", json.dumps([GOOD_SAMPLE])):
        path = _write(tmp_path / "arr.jsonl", [first] + [json.dumps(GOOD_SAMPLE)] * 30)
        status, result, err = analyze_cli(path, tmp_path / f"out{len(first)}")
        assert status == 0, err
        assert "arr.jsonl line 1: expected a JSON object, got array" in err, err
        assert result is not None and result["input"]["samples"] == 30 and result["input"]["issues_total"] == 1
    # a JSON array is a .json file (and stays one, whatever its layout)
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([GOOD_SAMPLE] * 3))
    status, result, err = analyze_cli(path, tmp_path / "json")
    assert status == 0 and result is not None and result["input"]["samples"] == 3, err


def test_python_dash_m_opbc_metrics_runs_the_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "opbc_metrics", "glossary", "--format", "md"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "# opbc-metrics glossary"
    proc = subprocess.run([sys.executable, "-m", "opbc_metrics"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "opbc-metrics" in proc.stderr


def test_a_pt_file_of_other_bytes_is_not_a_readable_torch_file(tmp_path):
    """Garbage bytes were refused as "needs pickle to load", which points at the wrong problem."""
    path = tmp_path / "notpt.pt"
    path.write_bytes(b"garbage")
    status, result, err = analyze_cli(path, tmp_path / "out")
    assert status == 1 and result is None
    assert "notpt.pt: not a readable torch file" in err and "pickle" not in err, err


def test_groups_without_tokens_have_no_ess_in_the_result_and_come_first_in_the_report(tmp_path):
    """They were reported with ESS 1 (sorted last among the worst groups, shown as "1")."""
    lines = []
    for g in range(25):
        mask = [0, 0, 0] if g % 5 == 4 else [1, 1, 1]  # 5 groups without a response token
        lines += [json.dumps({**GOOD_SAMPLE, "group_id": f"g{g}", "response_mask": mask})] * 2
    status, result, err = analyze_cli(_write(tmp_path / "mixed.jsonl", lines), tmp_path / "out")
    assert status == 0 and result is not None, err
    groups = result["controller"]["groups"]
    empty = [g for g in groups if g["stats"]["num_response_tokens"] == 0]
    assert len(empty) == 5 and all(g["decision"] == "reject" for g in empty)
    for name in ("ess", "clipped_fraction", "veto_fraction", "max_abs_log_ratio"):
        assert all(g["stats"][name] is None for g in empty), name
        assert all(isinstance(g["stats"][name], float) for g in groups if g not in empty), name
    assert {g["group"] for g in worst_groups(groups, limit=5)} == {g["group"] for g in empty}
    html = render_html({**result, "metrics": {}})
    table = html[html.index('id="groups-table"'):]
    rows = table.split("</tr>")[1:21]
    assert all("<td>no_response_tokens</td>" in r for r in rows[:5]) and MISSING in rows[0]
    assert ">1<" not in table and ">1.0<" not in table


@pytest.mark.parametrize("value", [0.99996, 0.9999999, 1 - 2**-52, 1.00004, 2.99995])
def test_a_value_that_is_not_an_integer_never_prints_as_one(value):
    """fmt(0.99996) was "1": an ESS that reads as exactly on-policy."""
    text = fmt(value)
    assert not float(text).is_integer() and float(text) == pytest.approx(value, rel=1e-4), text
    assert fmt(0.123456) == "0.1235" and fmt(1.0) == "1"  # the compact form is kept otherwise


# -- Keys outside the input schema ------------------------------------------------------------------------
# A key meant for a schema field that the reader would ignore: the mask defaulted to all ones, the rewards to
# none, each sample to its own group, silently.
MISNAMED = [("mask", "response_mask"), ("respons_mask", "response_mask"), ("completion_mask", "response_mask"),
            ("rewards", "reward"), ("group_ids", "group_id"), ("response_lengths", "response_length"),
            ("rollout_expert", "rollout_experts"), ("stepp", "step")]


def _value_for(meant: str):
    return {"response_mask": [1, 1, 0], "reward": 1.0, "group_id": 0, "response_length": 3, "step": 1,
            "rollout_experts": [[[0, 1]]] * 3}[meant]


@pytest.mark.parametrize("key,meant", MISNAMED)
def test_a_jsonl_key_that_looks_like_a_schema_key_is_an_issue_of_its_line(tmp_path, key, meant):
    good = json.dumps(GOOD_SAMPLE)
    lines = [good] * 3 + [json.dumps({**GOOD_SAMPLE, key: _value_for(meant)})] + [good] * 30
    for name in ("typo.jsonl", "typo.json"):
        path = _write(tmp_path / name, lines) if name.endswith("l") else tmp_path / name
        if name.endswith(".json"):  # a JSON array, one element per line: the same line numbers
            path.write_text("[" + ",\n".join(lines) + "]\n")
        status, result, err = analyze_cli(path, tmp_path / name.replace(".", "_"))
        assert status == 0, err
        assert f"{name} line 4: unknown key `{key}`: did you mean `{meant}`?" in err, err
        assert result is not None and result["input"]["samples"] == 33 and result["input"]["issues_total"] == 1
        assert result["input"]["issues"][0]["line"] == 4 and result["input"]["ignored_keys"] == {}


def test_every_misnamed_key_of_a_sample_is_named_at_once(tmp_path):
    """The auditors' typo.jsonl: `mask`, `group_ids` and `rewards` gave ESS 0.333 and three groups instead of one."""
    sample = {"trainer_logprobs": [-1.0, -0.5, -9.0], "rollout_logprobs": [-1.1, -0.5, -60.0], "mask": [1, 1, 0],
              "group_ids": 0, "rewards": 1.0}
    status, result, err = analyze_cli(_write(tmp_path / "typo.jsonl", [json.dumps(sample)] * 3), tmp_path / "out")
    assert status == 1 and result is None and "no valid sample (3 issue(s)" in err, err
    line = next(x for x in err.splitlines() if "line 1:" in x)
    for key, meant in (("mask", "response_mask"), ("group_ids", "group_id"), ("rewards", "reward")):
        assert f"unknown key `{key}`: did you mean `{meant}`?" in line, line


def test_other_unknown_keys_are_ignored_and_listed_once_with_their_counts(tmp_path):
    lines = ([json.dumps({**GOOD_SAMPLE, "prompt": "2+2?", "uid": f"u{i}"}) for i in range(5)]
             + [json.dumps({**GOOD_SAMPLE, "uid": "u9", "text": None})] * 2 + [json.dumps(GOOD_SAMPLE)] * 3
             # a framework name is ignored when its schema field is given: it is not meant for it
             + [json.dumps({**GOOD_SAMPLE, "response_mask": [1, 1, 1], "mask": [1, 1, 0]})])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["analyze", str(_write(tmp_path / "extra.jsonl", lines)), "--out", str(tmp_path / "o"),
                       "--no-html"])
    assert status == 0 and "skipped" not in err.getvalue(), err.getvalue()
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    assert result["input"]["samples"] == 11 and result["input"]["issues_total"] == 0
    assert result["input"]["ignored_keys"] == {"uid": 7, "prompt": 5, "mask": 1}  # a null value carries nothing
    summary = [x for x in out.getvalue().splitlines() if "outside the schema" in x]
    assert summary == ["  ignored   keys outside the schema: uid (7 samples), prompt (5 samples), mask (1 samples)"]
    # the same metrics as the file without those keys
    plain = [json.dumps({k: v for k, v in json.loads(x).items() if k not in ("prompt", "uid", "text", "mask")})
             for x in lines]
    status, clean, err2 = analyze_cli(_write(tmp_path / "plain.jsonl", plain), tmp_path / "p")
    assert status == 0 and clean is not None and clean["metrics"] == result["metrics"], err2
    assert clean["input"]["ignored_keys"] == {}
    assert not [x for x in summary_text(clean) if "outside the schema" in x]


def summary_text(result: dict) -> list[str]:
    from opbc_metrics.cli import summary_lines

    return summary_lines(result)


def _pt_batch(rows: int = 4) -> dict:
    t = torch.tensor([[-1.0, -0.5, -2.0]] * rows)
    return {"trainer_logprobs": t, "rollout_logprobs": t - 0.1, "group_ids": torch.zeros(rows, dtype=torch.int64)}


@pytest.mark.parametrize("key,meant,value", [
    ("respons_mask", "response_mask", torch.ones(4, 3)), ("mask", "response_mask", torch.ones(4, 3)),
    ("reward", "rewards", torch.ones(4)), ("group_id", "group_ids", torch.zeros(4, dtype=torch.int64)),
])
def test_a_pt_key_that_looks_like_a_schema_key_is_an_issue_of_its_record(tmp_path, key, meant, value):
    batch = _pt_batch()
    if key == "group_id":
        del batch["group_ids"]
    path = tmp_path / "steps.pt"
    torch.save([_pt_batch(), {**batch, key: value}, _pt_batch()], path)
    status, result, err = analyze_cli(path, tmp_path / "out", "--max-bad-fraction", "1")
    assert status == 0, err
    assert f"steps.pt record 1: unknown key `{key}`: did you mean `{meant}`?" in err, err
    assert result is not None and result["input"]["samples"] == 8 and result["input"]["issues_total"] == 1


def test_other_pt_keys_are_ignored_and_listed(tmp_path):
    path = tmp_path / "extra.pt"
    torch.save({**_pt_batch(), "uid": ["a", "b", "c", "d"], "meta": torch.zeros(2)}, path)
    status, result, err = analyze_cli(path, tmp_path / "out", "--batch-size", "3")
    assert status == 0 and result is not None, err
    assert result["input"]["ignored_keys"] == {"meta": 4, "uid": 4}  # samples (rows) of the record


def test_a_step_too_large_is_an_issue_of_its_line_or_record(tmp_path):
    """`"step": 10**30` was accepted (then matplotlib warned while drawing the charts)."""
    lines = ([json.dumps({**GOOD_SAMPLE, "step": 1})] * 3 + [json.dumps({**GOOD_SAMPLE, "step": 10**30})]
             + [json.dumps(GOOD_SAMPLE)] * 30)
    status, result, err = analyze_cli(_write(tmp_path / "big.jsonl", lines), tmp_path / "out")
    assert status == 0, err
    assert "big.jsonl line 4: `step` is too large (31 digits): at most 2**63 - 1" in err, err
    assert result is not None and result["input"]["samples"] == 33 and result["input"]["issues_total"] == 1
    path = tmp_path / "steps.pt"
    torch.save([{**_pt_batch(), "step": 2**63}, {**_pt_batch(), "step": 2**63 - 1}], path)
    status, result, err = analyze_cli(path, tmp_path / "pt", "--max-bad-fraction", "1")
    assert status == 0, err
    assert "steps.pt record 0: `step` is too large (19 digits)" in err, err
    assert result is not None and result["input"]["samples"] == 4 and result["input"]["issues_total"] == 1


@pytest.mark.parametrize("name", ["dup.jsonl", "dup.json"])
def test_a_key_given_twice_in_a_sample_is_an_issue_of_its_line(tmp_path, name):
    """JSON keeps the last of two equal keys and drops the other silently: `"response_mask"` given twice was read
    as whichever came last."""
    good = json.dumps(GOOD_SAMPLE)
    twice = '{"trainer_logprobs": [-1.0, -0.5, -2.0], "rollout_logprobs": [-1.1, -0.5, -1.9], ' \
            '"response_mask": [1, 1, 1], "response_mask": [0, 0, 1]}'
    lines = [good] * 3 + [twice] + [good] * 30
    text = "\n".join(lines) + "\n" if name.endswith("l") else "[\n" + ",\n".join(lines) + "\n]\n"
    path = tmp_path / name
    path.write_text(text)
    status, result, _ = analyze_cli(path, tmp_path / "out")
    assert status == 0, result
    issues = result["input"]["issues"]
    line = 4 if name.endswith("l") else 5  # (the array's "[" is line 1)
    assert [i["line"] for i in issues] == [line] and "`response_mask` appears twice" in issues[0]["message"]
    assert result["input"]["samples"] == 33


def test_the_positive_logprob_issue_of_a_line_is_its_first_on_a_response_token(tmp_path):
    """The positive-logprob check runs in the pass that reads the logprob values (it was a second pass): each line
    keeps its issue text (the first such value on a response token, `trainer_logprobs` before `rollout_logprobs`,
    after the mask's own issues), and the samples and issue counts stay the same."""
    from opbc_metrics.batch import PROBABILITY_TOLERANCE
    from opbc_metrics.io import SampleError, parse_sample, read_jsonl

    t, r = [-1.0, -0.5, -2.0], [-1.1, -0.5, -1.9]
    tol = PROBABILITY_TOLERANCE
    not_logprobs = "logprobs must be <= 0 (log-probabilities)"
    cases = [  # (sample, the issue's start or None)
        ({"trainer_logprobs": [0.5, 3, -1.0], "rollout_logprobs": r}, "`trainer_logprobs` holds 0.5 at index 0"),
        ({"trainer_logprobs": [-1.0, 3, 0.5], "rollout_logprobs": r}, "`trainer_logprobs` holds 3 at index 1"),
        ({"trainer_logprobs": [0.5, 3, -1.0], "rollout_logprobs": r, "response_mask": [0, 1, 1]},
         "`trainer_logprobs` holds 3 at index 1"),
        ({"trainer_logprobs": t, "rollout_logprobs": [-1.0, None, 7.25], "response_mask": [1, 1, True]},
         "`rollout_logprobs` holds 7.25 at index 2"),
        ({"trainer_logprobs": [-1.0, 2.0, -1.0], "rollout_logprobs": [9.0, -1.0, -1.0]},
         "`trainer_logprobs` holds 2 at index 1"),
        ({"trainer_logprobs": [-1.0, 2.0, -1.0], "rollout_logprobs": [9.0, -1.0, -1.0], "response_mask": [1, 0, 1]},
         "`rollout_logprobs` holds 9 at index 0"),
        ({"trainer_logprobs": [2.0, -1.0, -1.0], "rollout_logprobs": r, "response_mask": [1, 2, 1]},
         "`response_mask` must contain only 0/1"),  # the mask's issue comes first
        ({"trainer_logprobs": [2.0, -1.0], "rollout_logprobs": r}, "`rollout_logprobs` has length 3"),
        ({"trainer_logprobs": [2.0, "x", -1.0], "rollout_logprobs": r}, "`trainer_logprobs` must be a list of numbers"),
        ({"trainer_logprobs": [2.0, -1.0, -1.0], "rollout_logprobs": [-1.0, 10**400, -1.0]},
         "`rollout_logprobs` holds an integer too large"),
        # not issues: +-inf and NaN (the non-finite count), within the tolerance, positive off the response
        ({"trainer_logprobs": [math.inf, -math.inf, math.nan], "rollout_logprobs": [tol, tol / 2, None]}, None),
        ({"trainer_logprobs": [0.5, 1, -1.0], "rollout_logprobs": [-1.0, 4, -1.0], "response_mask": [0, 0, 1]}, None),
        ({"trainer_logprobs": [], "rollout_logprobs": []}, None),
    ]
    for sample, issue in cases:
        if issue is None:
            parse_sample(sample)
            continue
        with pytest.raises(SampleError) as err:
            parse_sample(sample)
        assert str(err.value).startswith(issue), (sample, str(err.value))
        assert ("holds" in issue and "at index" in issue) == (not_logprobs in str(err.value)), str(err.value)
    path = tmp_path / "pos.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s, _ in cases))  # json writes inf / nan as Infinity / NaN
    issues = [item for item in read_jsonl(str(path), batch_size=4) if not hasattr(item, "tensors")]
    want = [(n, issue) for n, (_, issue) in enumerate(cases, 1) if issue is not None]
    assert [i.line for i in issues] == [n for n, _ in want]
    assert all(i.message.startswith(issue) for i, (_, issue) in zip(issues, want, strict=True)), issues
