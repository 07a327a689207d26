"""The ``opbc-metrics`` CLI: subprocess runs on fixture files, the JSON result against an OPBCCollection
fed independently, the HTML report parsed for its charts, and hostile inputs."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.cli import import_all_metrics, main, summary_lines
from opbc_metrics.collection import DEFAULT_SECTIONS
from opbc_metrics.controller import Action, OPBCController
from opbc_metrics.glossary import glossary_dict
from opbc_metrics.report import STEP_KEYS, fmt, render_html, render_report, symlog_edges
from tests.data import concat_batches, logprobs_numpy
from tests.support import ROOT, load_module

FIXTURES = Path(__file__).parent / "fixtures" / "cli"
JSONL = FIXTURES / "rollouts.jsonl"
GEN = load_module(FIXTURES / "make_fixtures.py", "cli_make_fixtures")
LINES = [x for x in JSONL.read_text().splitlines() if x.strip()]
SAMPLES = [json.loads(x) for x in LINES]  # read independently of the CLI's parser


def run_cli(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "opbc_metrics.cli", *args], input=input, capture_output=True,
                          text=input is None, timeout=120, cwd=ROOT, env=env)


def run_main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(args))
    return status, out.getvalue(), err.getvalue()


def analyze(path: Path | str, out: Path, *options: str, status: int = 0) -> tuple[dict | None, str, str]:
    """``opbc-metrics analyze PATH --out OUT *OPTIONS`` in process, exiting with ``status``: (result.json or None,
    stdout, stderr)."""
    got, stdout, err = run_main("analyze", str(path), "--out", str(out), *options)
    assert got == status, (got, err)
    return json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else None, stdout, err


# -- An independent reading of the JSONL fixture, fed to a collection one prompt group at a time -----------
def _sample_batch(s: dict, group_id: int) -> dict:
    def f64(values):
        return torch.tensor([[math.nan if v is None else v for v in values]], dtype=torch.float64)

    batch = {"trainer_logprobs": f64(s["trainer_logprobs"]), "rollout_logprobs": f64(s["rollout_logprobs"]),
             "response_mask": torch.tensor([s.get("response_mask", [1] * len(s["trainer_logprobs"]))]),
             "group_ids": torch.tensor([group_id])}
    if "rollout_experts" in s:
        batch["rollout_experts"] = torch.tensor([s["rollout_experts"]])
        batch["trainer_experts"] = torch.tensor([s["trainer_experts"]])
    for key, field in (("policy_lag", "policy_lag"), ("reward", "rewards"), ("advantage", "advantages")):
        if key in s:
            batch[field] = torch.tensor([float(s[key])], dtype=torch.float64)
    for key in ("prompt_length", "response_length"):
        if key in s:
            batch[key + "s"] = torch.tensor([s[key]])
    for key in ("stop_reason", "discard_reason"):
        if key in s:
            batch[key + "s"] = [s[key]]
    return batch


def _collate(parts: list[dict]) -> dict:
    """Concatenate single-sample batches on the fields they all have, right-padding the time dim (masked)."""
    common = set.intersection(*(set(p) for p in parts))
    return concat_batches([{k: v for k, v in p.items() if k in common} for p in parts])


def reference_metrics(samples: list[dict], sections=DEFAULT_SECTIONS, **settings: float) -> dict[str, float]:
    """Feed the collection (section ``settings`` such as ``clamp``) one prompt group per update (as a training step
    holds whole groups)."""
    metrics = OPBCCollection(sections=sections, **settings)
    labels: dict[str, int] = {}
    runs: list[list[dict]] = []
    for i, s in enumerate(samples):
        label = str(s["group_id"]) if "group_id" in s else f"#{i}"
        part = _sample_batch(s, labels.setdefault(label, len(labels)))
        if runs and int(runs[-1][-1]["group_ids"][0]) == labels[label]:
            runs[-1].append(part)
        else:
            runs.append([part])
    for run in runs:
        metrics.update(_collate(run))
    return {k: v.tolist() for k, v in metrics.compute().items()}


def collection_on(batch: dict, sections) -> dict:
    ref = OPBCCollection(sections=sections)
    ref.update(batch)
    return {k: v.tolist() for k, v in ref.compute().items()}


def reference_histograms(samples: list[dict]) -> tuple[list[int], list[int]]:
    """numpy: searchsorted over the inner edges (bins (lo, hi]) of valid-token and valid-sequence ratios."""
    edges = np.array(symlog_edges())
    tokens, seqs = [], []
    for s in samples:
        t, r, m = (x[0] for x in logprobs_numpy(_sample_batch(s, 0)))
        m = m != 0
        finite = np.isfinite(t) & np.isfinite(r)
        valid = m & finite
        tokens.extend((t - r)[valid].tolist())
        if valid.any() and not (m & ~finite).any():
            seqs.append(float((t - r)[valid].sum()))
    count = lambda xs: np.bincount(np.searchsorted(edges, np.array(xs), side="left"),  # noqa: E731
                                   minlength=len(edges) + 1).tolist()
    return count(tokens), count(seqs)


def assert_close(got, expected, key):
    if isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), key
        for g, e in zip(got, expected):
            assert_close(g, e, key)
        return
    got = float(got)  # "inf"/"nan" strings parse too
    if math.isnan(expected):
        assert math.isnan(got), key
    else:
        assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (key, got, expected)


def assert_metrics(got: dict, want: dict, keys=None) -> None:
    for key in want if keys is None else keys:
        assert_close(got[key], want[key], key)


# -- HTML parsing -------------------------------------------------------------------------------------------
class ReportParser(HTMLParser):
    """Every tag with its attributes, the page's text, and each chart's title (the first <title> of its <svg>)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.svgs: dict[str, str] = {}
        self.parts: list[str] = []
        self._svg, self._title = None, False
        self.feed(html)
        self.close()
        self.text = "".join(self.parts)
        for tag, attrs in self.tags:  # every report is self-contained
            assert tag not in ("script", "link", "iframe", "img", "object", "embed"), tag
            for name in ("src", "href"):
                assert not attrs.get(name) or attrs[name].startswith("#"), (tag, name, attrs[name])

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "svg":
            self._svg = dict(attrs).get("id")
            self.svgs[self._svg] = ""
        self._title = tag == "title" and self._svg is not None and not self.svgs[self._svg]

    def handle_endtag(self, tag):
        self._svg = None if tag == "svg" else self._svg
        self._title = False

    def handle_data(self, data):
        self.parts.append(data)
        if self._title:
            self.svgs[self._svg] += data


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("jsonl")
    proc = run_cli("analyze", str(JSONL), "--out", str(out), "--batch-size", "16")
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else None
    html = (out / "report.html").read_text() if (out / "report.html").exists() else ""
    return proc, result, html


def test_fixtures_are_reproducible(tmp_path):
    paths = GEN.write_all(str(tmp_path))
    for name in ("rollouts.jsonl", "hostile.jsonl"):
        assert Path(paths[name]).read_bytes() == (FIXTURES / name).read_bytes(), name
    new = torch.load(paths["rollouts.pt"], weights_only=True)
    old = torch.load(FIXTURES / "rollouts.pt", weights_only=True)
    assert new.keys() == old.keys()
    for k in new:
        assert torch.equal(new[k], old[k]) if isinstance(new[k], torch.Tensor) else new[k] == old[k], k


# -- analyze on the JSONL fixture (one subprocess run shared by these tests) ----------------------------------
def test_analyze_jsonl_runs_and_prints_a_summary(jsonl_run):
    proc, result, _ = jsonl_run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    # batches of 16: 0-15, 16-31, 32-43 (q11 has no expert ids: a new batch), 44-47
    assert "input     jsonl: 48 samples in 4 batches, 12 groups" in out
    assert "opbc/is" in out and "ess" in out and "moe/router" in out
    assert "layer_{i}/flip_rate" in out and "[3 layers]" in out  # capacity 64 collapsed to the 3 seen
    assert "result.json" in out and "report.html" in out
    assert result["input"]["issues_total"] == 0


def test_json_result_equals_collection_on_the_same_data(jsonl_run):
    _, result, _ = jsonl_run
    assert set(DEFAULT_SECTIONS) <= set(result["settings"]["sections"])
    ref = reference_metrics(SAMPLES, result["settings"]["sections"])
    assert set(ref) <= set(result["metrics"])
    # Rounds no sequence reached (and the unused overflow bucket) have no keys: "no data in the input".
    unreached = {k for k, why in result["not_computed"].items()
                 if k.startswith("per_round/") and why.startswith("no data")}
    assert not any(k.startswith(("opbc/", "moe/", "per_round/")) for k in set(result["not_computed"]) - unreached)
    # the only extra keys are the controller's budget metrics
    assert all(k.startswith("opbc/decision/") for k in set(result["metrics"]) - set(ref))
    assert_metrics(result["metrics"], ref)
    assert result["input"]["samples"] == len(SAMPLES) == 48
    assert result["input"]["groups"] == 12
    assert result["input"]["layers_seen"] == 3
    assert result["metrics"]["opbc/input/nonfinite_count"] > 0  # q11's -Infinity
    assert result["metrics"]["opbc/is/veto_fraction"] > 0  # q9's -9999 sentinel
    assert result["metrics"]["rollout/discarded/max_async"] == 4  # q10
    assert "rollout" in result["settings"]["sections"]  # optional-input sections run by default


def test_histograms_match_numpy(jsonl_run):
    _, result, _ = jsonl_run
    tokens, seqs = reference_histograms(SAMPLES)
    assert result["histograms"]["token_log_ratio"]["edges"] == symlog_edges()
    assert result["histograms"]["token_log_ratio"]["counts"] == tokens
    assert result["histograms"]["sequence_log_ratio"]["counts"] == seqs
    assert sum(tokens) == result["metrics"]["opbc/input/num_tokens"]
    assert sum(seqs) == result["metrics"]["opbc/input/num_sequences"]


def test_html_report_has_its_charts(jsonl_run):
    _, result, html = jsonl_run
    parser = ReportParser(html)
    svgs = parser.svgs
    for chart in ("chart-token-log-ratio", "chart-sequence-log-ratio", "chart-per-layer-moe-router-flip_rate",
                  "chart-step-opbc-is-ess", "chart-step-moe-router-flip_rate"):
        assert svgs.get(chart), chart
    # the fixture has no step field: one point per batch, and the page says so
    assert svgs["chart-step-opbc-is-ess"] == "ESS (token) over batches"
    assert "each point is one batch" in parser.text
    assert result["controller"]["available"]
    assert "chart-decision-mix" in svgs and "chart-decision-steps" in svgs
    assert "groups-table" in html and "metrics-table" in html


def test_controller_decisions_per_group(jsonl_run):
    _, result, _ = jsonl_run
    controller = result["controller"]
    groups = {g["group"]: g for g in controller["groups"]}
    assert groups.keys() == GEN.EXPECTED_DECISIONS.keys()
    for label, (decision, reason) in GEN.EXPECTED_DECISIONS.items():
        assert groups[label]["decision"] == decision, (label, groups[label])
        assert (groups[label]["reasons"] or [None])[0] == reason, (label, groups[label])
        assert groups[label]["batches"] == 1
        # each group's decision is the controller's on that group's rows alone
        rows = [_sample_batch(s, 0) for s in SAMPLES if str(s["group_id"]) == label]
        (d,) = OPBCController().evaluate(_collate(rows)).decisions
        assert d.action.value == groups[label]["decision"], label
        assert [r.value for r in d.reasons] == groups[label]["reasons"], label
        assert math.isclose(d.report.ess, groups[label]["stats"]["ess"], rel_tol=1e-9), label
    mix = controller["decision_mix"]
    assert mix == {"train": 5, "train_with_correction": 1, "replay": 2, "quarantine": 3, "reject": 1}
    for action, n in mix.items():
        assert math.isclose(result["metrics"][f"opbc/decision/group_share/{action}"], n / 12)


def test_groups_split_across_batches_keep_the_strictest_decision(tmp_path):
    """Interleaved groups with batches of 2: every group is decided in 4 batches, the strictest is kept."""
    GEN.write_jsonl(tmp_path / "interleaved.jsonl", [SAMPLES[g * 4 + i] for i in range(4) for g in range(12)])
    result, _, _ = analyze(tmp_path / "interleaved.jsonl", tmp_path / "o", "--batch-size", "2", "--no-html")
    groups = {g["group"]: g for g in result["controller"]["groups"]}
    assert "12 group(s) were split across batches" in result["controller"]["note"]
    strictness = {a.value: a.strictness for a in Action}
    for label in GEN.EXPECTED_DECISIONS:
        rows = [s for s in SAMPLES if str(s["group_id"]) == label]
        singles = [OPBCController().evaluate(_sample_batch(s, 0)).decisions[0] for s in rows]
        strictest = max(singles, key=lambda d: d.action.strictness)
        assert groups[label]["batches"] == 4
        assert groups[label]["decision"] == strictest.action.value, label
        assert strictness[groups[label]["decision"]] == max(strictness[d.action.value] for d in singles)
        assert set(groups[label]["reasons"]) == {r.value for d in singles for r in d.reasons}, label
    # the metrics do not depend on how the file was batched
    assert_metrics(result["metrics"], reference_metrics(SAMPLES, result["settings"]["sections"]),
                   ("opbc/is/ess", "opbc/kl/k3", "moe/router/flip_rate", "per_round/round_1_abs_diff_mean"))


# -- .pt input, batch-size invariance, options -------------------------------------------------------------
def test_pt_file_equals_its_batch_and_the_jsonl(tmp_path, jsonl_run):
    result, _, _ = analyze(FIXTURES / "rollouts.pt", tmp_path, "--batch-size", "7")
    assert result["input"]["format"] == "pt" and result["input"]["samples"] == 48
    assert result["input"]["batches"] == 6  # slices of 7 rows extended to the end of a group of 4
    batch = torch.load(FIXTURES / "rollouts.pt", weights_only=True)
    assert_metrics(result["metrics"], collection_on(batch, result["settings"]["sections"]))
    # everything but the router metrics agrees with the JSONL run (the .pt adds expert ids for q11 only)
    _, jsonl_result, _ = jsonl_run
    assert set(result["metrics"]) == set(jsonl_result["metrics"])
    assert_metrics(result["metrics"], {k: float(v) for k, v in jsonl_result["metrics"].items()
                                       if not k.startswith(("moe/", "opbc/decision/"))})
    assert result["histograms"] == jsonl_result["histograms"]


def test_batch_size_and_limit(tmp_path):
    runs = {}
    for bs in ("1", "64"):
        runs[bs], _, _ = analyze(JSONL, tmp_path / bs, "--batch-size", bs, "--no-html")
        assert not (tmp_path / bs / "report.html").exists()
    assert_metrics(runs["1"]["metrics"], {k: v if isinstance(v, list) else float(v)
                                          for k, v in runs["64"]["metrics"].items()})
    # batch size 1: a group's 4 consecutive samples stay together; 64: 0-43, then q11 (no expert ids)
    assert runs["1"]["input"]["batches"] == 12 and runs["64"]["input"]["batches"] == 2
    limited, _, _ = analyze(JSONL, tmp_path / "l", "--limit", "5")
    assert limited["input"]["samples"] == 5
    ref = reference_metrics(SAMPLES[:5], limited["settings"]["sections"])
    assert_metrics(limited["metrics"], ref, ["opbc/is/ess"])


def test_clamp_and_veto_options_reach_the_metrics(tmp_path):
    result, out, _ = analyze(JSONL, tmp_path, "--clamp", "5", "--veto", "10000", "--no-html")
    assert result["settings"]["clamp"] == 5 and result["metrics"]["opbc/is/veto_fraction"] == 0
    assert "clamp C = 5 nats, veto = 10000 nats" in out
    sections = result["settings"]["sections"]
    assert_metrics(result["metrics"], reference_metrics(SAMPLES, sections, clamp=5.0, veto=10000.0))
    default = reference_metrics(SAMPLES, sections, veto=10000.0)  # the default clamp gives other weights here
    assert not math.isclose(result["metrics"]["opbc/is/ess"], default["opbc/is/ess"], rel_tol=1e-3)


def usage_error(*args: str) -> str:
    """``main(args)`` exits with status 2 (argparse's usage error) before writing anything: its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2, (args, err.getvalue())
    assert "Traceback" not in err.getvalue()
    return err.getvalue()


def test_bad_options_exit_2_without_traceback(tmp_path):
    for args in (["analyze", "x.jsonl", "--clamp", "-1"], ["analyze", "x.jsonl", "--batch-size", "0"],
                 ["analyze", "x.jsonl", "--on-error", "ignore"], ["frobnicate"]):
        usage_error(*args)


@pytest.mark.parametrize(("args", "fragments"), [
    (["--preset", "truncated"],
     ["argument --preset: invalid choice: 'truncated'", "'default', 'masked_is', 'truncated_is'"]),
    (["--sections", "mismtach"],
     ["argument --sections: unknown section(s) 'mismtach' (did you mean 'mismatch'?)", "'moe'", "or 'all'"]),
    (["--sections", "mismatch,nope"], ["argument --sections: unknown section(s) 'nope';", "'per_round'"]),
    (["--sections", ","], ["argument --sections: expected at least one section"]),
    (["--sections", "all,moe"], ["argument --sections: 'all' cannot be combined"]),
    (["--veto", "10"], ["argument --clamp/--veto/--preset:", "`veto` (10.0) must be >= `clamp` (20.0)"]),
    (["--max-issues-shown", "-1"], ["argument --max-issues-shown: expected an integer >= 0"]),
])
def test_every_bad_option_value_is_a_usage_error(tmp_path, args, fragments):
    """Exit status 2 with argparse's message naming the option and the valid values, as ``--help`` promises
    (``--preset`` and ``--sections`` exited 1 from inside the analysis), and no output written."""
    err = usage_error("analyze", str(JSONL), "--out", str(tmp_path / "o"), *args)
    assert err.startswith("usage: opbc-metrics analyze"), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "o").exists()


def test_bad_preset_and_sections_exit_2_from_the_process(tmp_path):
    for args in (["--preset", "truncated"], ["--sections", "mismtach"]):
        proc = run_cli("analyze", str(JSONL), "--out", str(tmp_path / "o"), *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"argument {args[0]}:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_controller_policy_options(tmp_path):
    result, _, _ = analyze(JSONL, tmp_path / "c", "--preset", "truncated_is", "--no-html")
    assert result["controller"]["policy"]["weight_cap"] == 2.0 and result["settings"]["preset"] == "truncated_is"


def test_progress_bar_is_tqdm_on_request_and_off_without_a_terminal(tmp_path):
    size = os.path.getsize(JSONL)
    err = analyze(JSONL, tmp_path / "a", "--progress", "--no-html")[2]
    # tqdm's bar (it throttles its redraws, so the last state drawn varies): the file name, a percentage,
    # and the file size as the total in bytes, scaled by tqdm
    assert err.startswith("\rrollouts.jsonl:") and "%|" in err and f"/{size / 1000:.1f}k [" in err, err
    assert "B/s]" in err
    assert analyze(JSONL, tmp_path / "c", "--no-html")[2] == ""  # not a terminal


# -- Hostile files -----------------------------------------------------------------------------------------
def test_hostile_jsonl_skip_reports_every_line(tmp_path):
    proc = run_cli("analyze", str(FIXTURES / "hostile.jsonl"), "--out", str(tmp_path))
    # 9 of 13 samples are bad, over --max-bad-fraction 0.1: exit status 1, after writing what it has
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "9 of 13 samples (69.2%) were bad and skipped, more than --max-bad-fraction 0.1" in proc.stderr
    reported = [line for line in proc.stderr.splitlines() if line.startswith("skipped: hostile.jsonl line ")]
    assert len(reported) == len(GEN.HOSTILE_ISSUES)
    for (line, fragment), text in zip(GEN.HOSTILE_ISSUES.items(), reported):
        assert text.startswith(f"skipped: hostile.jsonl line {line}: "), text
        assert fragment in text, (fragment, text)
    result = json.loads((tmp_path / "result.json").read_text())
    assert [i["line"] for i in result["input"]["issues"]] == list(GEN.HOSTILE_ISSUES)
    assert result["input"]["samples"] == len(GEN.HOSTILE_VALID_LINES)
    assert "4 samples" in proc.stdout and f"{len(GEN.HOSTILE_ISSUES)} issue(s) skipped" in proc.stdout
    # the valid lines, read independently, give the same metrics
    lines = (FIXTURES / "hostile.jsonl").read_text().splitlines()
    ref = reference_metrics([json.loads(lines[n - 1]) for n in GEN.HOSTILE_VALID_LINES], result["settings"]["sections"])
    assert set(ref) == {k for k in result["metrics"] if not k.startswith("opbc/decision/")}
    assert "moe/router/flip_rate" in result["not_computed"]  # no expert ids in the file
    assert_metrics(result["metrics"], ref)
    assert result["input"]["bad_samples"] == 9 and math.isclose(result["input"]["bad_fraction"], 9 / 13)
    assert "line 14" in ReportParser((tmp_path / "report.html").read_text()).text
    proc = run_cli("analyze", str(FIXTURES / "hostile.jsonl"), "--out", str(tmp_path / "b"), "--max-bad-fraction", "1")
    assert proc.returncode == 0 and "max-bad-fraction" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name,args,fragments,absent", [
    ("hostile.jsonl", ("--on-error", "fail"), ("hostile.jsonl line 3: invalid JSON",), "line 5"),
    ("pickled.pt", (), ("refused", "pickle", "weights_only=True"), "PWNED"),
])
def test_a_refused_file_exits_1_without_traceback_or_result(tmp_path, name, args, fragments, absent):
    """--on-error fail stops at the first bad line; a pickled .pt is refused without unpickling it."""
    proc = run_cli("analyze", str(FIXTURES / name), "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert all(f in proc.stderr for f in fragments), proc.stderr
    assert absent not in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "result.json").exists()


def _good() -> dict:
    return {k: v[:3] for k, v in torch.load(FIXTURES / "rollouts.pt", weights_only=True).items()}


HOSTILE_FILES = {
    # name: (maker, expected status, fragment of the message)
    "empty.jsonl": (lambda p: p.write_bytes(b""), 1, "empty file, no samples"),
    "blank.jsonl": (lambda p: p.write_bytes(b"\n  \n\n"), 1, "empty file, no samples"),
    "all_bad.jsonl": (lambda p: p.write_text('{"a": 1}\n[]\n'), 1, "no valid sample (2 issue(s)"),
    "cut.jsonl": (lambda p: p.write_text('{"trainer_logprobs": [-1.0], "rollout'), 1, "line 1: truncated"),
    "latin1.jsonl": (lambda p: p.write_bytes(b'{"trainer_logprobs": [-1.0], "x": "\xe9"}\n'), 1,
                     "line 1: not valid UTF-8"),
    "deep.jsonl": (lambda p: p.write_text("[" * 100000 + "]" * 100000 + "\n"), 1, "line 1: invalid JSON"),
    "gz.jsonl": (lambda p: p.write_bytes(gzip.compress(b'{"trainer_logprobs": [-1.0]}\n')), 1,
                 "`rollout_logprobs` is required but missing"),
    "cut.jsonl.gz": (lambda p: p.write_bytes(gzip.compress(b'{"trainer_logprobs": [-1.0]}\n')[:-9]), 1,
                     "corrupt or cut gzip stream"),
    "empty.json": (lambda p: p.write_text("[]"), 1, "empty file, no samples"),
    "rollouts.csv": (lambda p: p.write_text("a,b\n"), 2, "unknown file extension .csv"),
    "noext": (lambda p: p.write_text("{}\n"), 2, "unknown file extension (none)"),
    "gz.gz": (lambda p: p.write_text("{}\n"), 2, "unknown file extension .gz"),
    "truncated.pt": (lambda p: p.write_bytes((FIXTURES / "rollouts.pt").read_bytes()[:5000]), 1,
                     "not a readable torch file"),
    "text.pt": (lambda p: p.write_text("hello, I am not a tensor file"), 1, "not a readable torch file"),
    "tensor.pt": (lambda p: torch.save(torch.zeros(3), p), 1, "expected a dict of tensors"),
    "missing.pt": (lambda p: torch.save({"trainer_logprobs": torch.zeros(2, 3)}, p), 1,
                   "`rollout_logprobs` is required but missing"),
    "wrongtype.pt": (lambda p: torch.save({**_good(), "rollout_logprobs": "oops"}, p), 1,
                     "`rollout_logprobs` must be a tensor, got str"),
    "rows.pt": (lambda p: torch.save({**_good(), "group_ids": torch.arange(5)}, p), 1,
                "`group_ids` has 5 rows but `trainer_logprobs` has 3 rows"),
    "int_logprobs.pt": (lambda p: torch.save({**_good(), "trainer_logprobs": torch.zeros(3, 40, dtype=torch.int64)}, p),
                        1, "`trainer_logprobs` must be a floating-point tensor"),
    "shape.pt": (lambda p: torch.save({**_good(), "rollout_logprobs": torch.zeros(3, 7)}, p), 1,
                 "`rollout_logprobs` has shape (3, 7) but `trainer_logprobs` has shape (3, "),
    "nope.jsonl": (lambda p: None, 2, "no such file"),
    "dir.jsonl": (lambda p: p.mkdir(), 1, "directory"),
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_hostile_files_give_clear_messages(tmp_path, name):
    make, expected_status, fragment = HOSTILE_FILES[name]
    path = tmp_path / name
    make(path)
    result, _, err = analyze(path, tmp_path / "out", status=expected_status)
    assert result is None, err
    assert fragment in err, err
    assert err.count("opbc-metrics: error:") == 1 and "Traceback" not in err


def _pt(tmp_path: Path, name: str, obj) -> Path:
    torch.save(obj, tmp_path / name)
    return tmp_path / name


def test_pt_list_of_records_skips_a_bad_record(tmp_path):
    good = _good()
    path = _pt(tmp_path, "steps.pt", [good, {"trainer_logprobs": "x", "rollout_logprobs": torch.zeros(1, 2)}, good])
    result, _, err = analyze(path, tmp_path / "o", "--no-html", "--max-bad-fraction", "1")
    assert "steps.pt record 1: `trainer_logprobs` must be a tensor" in err
    assert result["input"]["samples"] == 6 and result["input"]["issues_total"] == 1


def test_failed_batch_rolls_back_every_member(tmp_path):
    """A .pt batch rejected by a metric's validation (float expert ids) leaves no partial state behind."""
    good = _good()
    path = _pt(tmp_path, "mixed.pt", [good, {**good, "rollout_experts": good["rollout_experts"].float()}])
    result, _, err = analyze(path, tmp_path / "o", "--no-html", "--max-bad-fraction", "1")
    assert "mixed.pt record 1 rows 0-2: " in err and "rollout_experts" in err
    assert_metrics(result["metrics"], collection_on(good, result["settings"]["sections"]))


def test_report_escapes_input_text():
    evil = '<script>alert("x")</script>'
    result = {
        "input": {"path": evil + ".jsonl", "format": "jsonl", "samples": 1, "issues_total": 1,
                  "issues": [{"where": "line 1", "line": 1, "message": evil}]},
        "settings": {"clamp": 20.0, "veto": 30.0},
        "metrics": {"opbc/is/ess": 0.5, "per_round/round_0_abs_diff_mean": 0.1, "per_round/round_1_abs_diff_mean": 0.2},
        "controller": {"available": True, "decision_mix": {"train": 3, "reject": 1},
                       "groups": [{"group": evil, "decision": "reject", "reasons": [evil]}]},
    }
    html = render_html(result)
    assert "<script" not in html and "&lt;script&gt;" in html
    parser = ReportParser(html)
    assert "chart-decision-mix" in parser.svgs and "chart-per-round-per_round-abs_diff_mean" in parser.svgs


def test_summary_lines_with_decisions():
    result = {
        "input": {"path": "f.jsonl", "format": "jsonl", "samples": 8, "batches": 1, "groups": 4, "issues_total": 0},
        "settings": {"clamp": 20.0, "veto": 30.0, "batch_size": 64},
        "metrics": {"opbc/is/ess": 0.25, "moe/router/layer_0/flip_rate": 0.1, "moe/router/layer_1/flip_rate": 0.3},
        "controller": {"available": True, "decision_mix": {"train": 3, "reject": 1}},
    }
    text = "\n".join(summary_lines(result))
    assert "ess" in text and "0.25" in text and "ESS" in text
    assert "layer_{i}/flip_rate" in text and "max 0.3 at layer 1" in text
    assert "decisions (4 groups): train 3 (75.0%), reject 1 (25.0%)" in text


# -- glossary and help ----------------------------------------------------------------------------------------
def test_glossary_command_outputs_every_key():
    assert import_all_metrics() == []  # every metric class of the package registers, as in the command
    script = Path(sys.executable).parent / "opbc-metrics"  # the console script, when installed next to python
    if script.exists():
        proc = subprocess.run([str(script), "glossary", "--format", "json"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    else:
        proc = run_cli("glossary", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    expected = glossary_dict()
    assert data.keys() == expected.keys()
    all_keys = {k for e in expected.values() for k in e["keys"]}
    assert {k for e in data.values() for k in e["keys"]} == all_keys
    status, md, _ = run_main("glossary")
    assert status == 0 and md.startswith("# opbc-metrics glossary")
    for key in all_keys:
        assert f"`{key}`" in md, key


def test_help_documents_the_schema():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(["analyze", "--help"])
    assert exc.value.code == 0
    for word in ("trainer_logprobs", "rollout_logprobs", "response_mask", "group_id", "rollout_experts",
                 "policy_lag", "weights_only=True", "--on-error", "--batch-size"):
        assert word in out.getvalue(), word


# -- Invalid values, the share of bad lines, other text formats, framework hints ------------------------------
@pytest.mark.parametrize("bad", ['"reward": NaN', '"reward": Infinity', '"advantage": -Infinity'])
def test_non_finite_scalar_is_reported_with_its_line_and_skipped(tmp_path, bad):
    lines = list(LINES)
    field, value = bad.split(": ")
    sample = {**json.loads(lines[29]), json.loads(field): float(value.replace("Infinity", "inf"))}
    lines[29] = json.dumps(sample)  # line 30 (the value replaces the sample's own: a key named twice is an issue)
    (tmp_path / "nan.jsonl").write_text("\n".join(lines) + "\n")
    result, _, err = analyze(tmp_path / "nan.jsonl", tmp_path / "out", "--no-html")  # 1 bad line of 48: allowed
    field = bad.split('"')[1]
    assert f"skipped: nan.jsonl line 30: `{field}` must be a finite number" in err
    assert [(i["line"], i["message"].split(" must")[0]) for i in result["input"]["issues"]] == [(30, f"`{field}`")]
    assert result["input"]["samples"] == 47 and result["input"]["bad_samples"] == 1
    # the other 47 samples, read independently, give the same metrics
    assert_metrics(result["metrics"], reference_metrics(SAMPLES[:29] + SAMPLES[30:], result["settings"]["sections"]))


def test_max_bad_fraction_exits_1_after_writing_everything(tmp_path):
    lines = LINES[:20]
    for n in (2, 5, 9):  # 3 of 20 samples bad: 15%
        lines[n] = lines[n][:-1] + ', "reward": NaN}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result, out, err = analyze(path, tmp_path / "a", status=1)
    assert "3 of 20 samples (15.0%) were bad and skipped, more than --max-bad-fraction 0.1" in err
    assert (tmp_path / "a" / "report.html").exists() and "wrote" in out
    assert result["input"]["samples"] == 17
    analyze(path, tmp_path / "b", "--max-bad-fraction", "0.15")
    proc = run_cli("analyze", str(path), "--out", str(tmp_path / "c"), "--max-bad-fraction", "1.5")
    assert proc.returncode == 2 and "expected a fraction in [0, 1]" in proc.stderr


def test_gzip_json_array_and_stdin_read_like_the_jsonl(tmp_path, jsonl_run):
    def without_path(result: dict) -> dict:  # the input's name and format differ
        return {**result, "input": {k: v for k, v in result["input"].items() if k not in ("path", "format")}}

    text = JSONL.read_text()
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "r.json").write_text("[\n" + ",\n".join(json.dumps(s) for s in SAMPLES) + "\n]\n")
    (tmp_path / "r.json.gz").write_bytes(gzip.compress((tmp_path / "r.json").read_bytes()))
    for name, data in (("r.jsonl.gz", None), ("r.json", None), ("r.json.gz", None), ("-", text.encode()),
                       ("/dev/stdin", gzip.compress(text.encode()))):
        out = tmp_path / f"out{len(os.listdir(tmp_path))}"
        source = name if data is not None else str(tmp_path / name)
        proc = run_cli("analyze", source, "--out", str(out), "--batch-size", "16", "--no-html", input=data)
        assert proc.returncode == 0, (name, proc.stderr)
        assert without_path(json.loads((out / "result.json").read_text())) == without_path(jsonl_run[1]), name


def test_json_array_reports_bad_elements_by_line(tmp_path):
    good = json.dumps({"trainer_logprobs": [-1.0, -0.5], "rollout_logprobs": [-1.1, -0.5]})
    path = tmp_path / "a.json"
    bad = '{"trainer_logprobs": [-1.0], "rollout_logprobs": "x"}'
    path.write_text("[\n" + good + ",\n" + good + ",\n" + bad + ",\n" + good + "\n]\n")
    options = ("--no-html", "--max-bad-fraction", "1")
    result, _, err = analyze(path, tmp_path / "o", *options)
    assert "skipped: a.json line 4: `rollout_logprobs` must be a list of numbers, got str" in err
    assert result["input"]["samples"] == 3
    path.write_text("[\n" + good + ",\n" + good + ",\n" + good[:-5] + "\n")  # cut in the third element
    err = analyze(path, tmp_path / "p", *options)[2]
    assert "a.json line 4: truncated JSON array" in err, err


def test_json_error_message_has_no_doubled_word(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"trainer_logprobs": [-1.0], "rollout_logprobs": [-1.0], "x": "unterminated}\n')
    err = analyze(path, tmp_path / "o", status=1)[2]
    assert "line 1: invalid JSON (Unterminated string starting at, column 63)" in err, err
    assert "at at" not in err


@pytest.mark.parametrize(
    ("name", "fields", "adapter"),
    [("f.jsonl", {"old_log_probs": [-1.0], "rollout_log_probs": [-1.1], "uid": "a"}, "verl.verl_to_batch"),
     ("f.jsonl", {"old_per_token_logps": [-1.0], "sampling_per_token_logps": [-1.1], "completion_mask": [1]},
      "trl.trl_to_batch"),
     ("verl.pt", {"old_log_probs": torch.zeros(2, 3), "rollout_log_probs": torch.zeros(2, 3)}, "verl.verl_to_batch")],
)
def test_framework_field_names_get_a_hint_naming_the_adapter(tmp_path, name, fields, adapter):
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save(fields, path)
    else:
        path.write_text((json.dumps(fields) + "\n") * 3)
    err = analyze(path, tmp_path / "o", status=1)[2]
    adapter = f"`opbc_metrics.integrations.{adapter}`"
    assert adapter in err, err
    if name.endswith(".jsonl"):
        assert "no valid sample" in err
        hint = [line for line in err.splitlines() if line.startswith("skipped: f.jsonl line 1:")]
        assert hint and "`trainer_logprobs` is required but missing" in hint[0] and adapter in hint[0], err


# -- Steps and several files --------------------------------------------------------------------------------
STEPPED = [{**s, "step": 10 + i // 12} for i, s in enumerate(SAMPLES)]  # 4 steps of 3 groups


def test_step_series_equal_a_collection_per_step(tmp_path):
    GEN.write_jsonl(tmp_path / "steps.jsonl", STEPPED)
    result, _, _ = analyze(tmp_path / "steps.jsonl", tmp_path / "o", "--no-html")
    steps = result["steps"]
    assert steps["axis"] == "step" and [p["x"] for p in steps["points"]] == [10, 11, 12, 13]
    for point in steps["points"]:
        part = [s for s in STEPPED if s["step"] == point["x"]]
        assert point["samples"] == len(part) == 12
        expected = {k: v for k, v in reference_metrics(part).items() if k in STEP_KEYS}
        if not any("rollout_experts" in s for s in part):  # a step without expert ids measured no flip rate
            expected.pop("moe/router/flip_rate")
        assert set(point["metrics"]) == set(expected), point["x"]
        assert_metrics(point["metrics"], expected)
    per_step = [p["decisions"] for p in steps["points"]]
    assert [sum(m.values()) for m in per_step] == [3, 3, 3, 3]
    total = {d: sum(m[d] for m in per_step) for d in result["controller"]["decision_mix"]}
    assert total == result["controller"]["decision_mix"]
    assert {g["group"]: g["step"] for g in result["controller"]["groups"]} == {
        str(s["group_id"]): s["step"] for s in STEPPED}


def test_several_files_make_one_comparison_report(tmp_path):
    GEN.write_jsonl(tmp_path / "bf16.jsonl", STEPPED[:24])
    text = "".join(json.dumps(s) + "\n" for s in STEPPED[24:])
    (tmp_path / "async.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    status, out, err = run_main("analyze", str(tmp_path / "bf16.jsonl"), str(tmp_path / "async.jsonl.gz"),
                                "--out", str(tmp_path / "o"))
    assert status == 0, err
    a = json.loads((tmp_path / "o" / "result-bf16.json").read_text())
    b = json.loads((tmp_path / "o" / "result-async.json").read_text())
    assert a["input"]["samples"] == b["input"]["samples"] == 24
    assert_metrics(b["metrics"], reference_metrics(STEPPED[24:], b["settings"]["sections"]))
    assert "wrote " + str(tmp_path / "o" / "report.html") in out
    parser = ReportParser((tmp_path / "o" / "report.html").read_text())
    ids = {a.get("id") for t, a in parser.tags if t == "g"}
    for stream in ("bf16", "async"):  # one line per stream, overlaid in the same charts
        assert f"chart-step-opbc-is-ess-series-{stream}" in ids and f"chart-token-log-ratio-hist-{stream}" in ids
    assert not (tmp_path / "o" / "result.json").exists()
    status, _, err = run_main("analyze", "-", "/dev/stdin", "--out", str(tmp_path / "p"))
    assert status == 2 and "standard input can be read only once" in err


def test_report_without_matplotlib_says_how_to_get_the_charts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert 'pip install ".[report]"' in analyze(JSONL, tmp_path)[2]
    parser = ReportParser((tmp_path / "report.html").read_text())
    assert not parser.svgs and 'pip install ".[report]"' in parser.text
    assert "groups-table" in (tmp_path / "report.html").read_text()


# Python runs sitecustomize before the program: matplotlib is then neither importable nor installed (torchmetrics
# and lightning_utilities ask importlib.metadata), as in an install without the `report` extra.
WITHOUT_MATPLOTLIB = """\
import importlib.metadata as metadata
import sys

sys.modules["matplotlib"] = None  # import matplotlib raises ModuleNotFoundError
_version = metadata.version


def _version_without_matplotlib(name):
    if name.lower() == "matplotlib":
        raise metadata.PackageNotFoundError(name)
    return _version(name)


metadata.version = _version_without_matplotlib
"""


def test_cli_runs_without_matplotlib(tmp_path):
    """Without the `report` extra the CLI starts (``--help``, ``python -m opbc_metrics``, the console script) and
    ``analyze`` writes the report without charts, saying how to get them: report.py imported matplotlib at
    import time, so every command failed with ModuleNotFoundError."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITHOUT_MATPLOTLIB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "COLUMNS": "120"}
    probe = "import importlib.util, sys; import opbc_metrics.cli; print(importlib.util.find_spec('matplotlib'))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr  # the blocker is in place

    script = Path(sys.executable).with_name("opbc-metrics")
    commands = [[sys.executable, "-m", "opbc_metrics"]] + ([[str(script)]] if script.exists() else [])
    for command in commands:
        proc = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env=env)
        assert proc.returncode == 0 and "analyze" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "opbc_metrics", "analyze", str(JSONL), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert 'note: the report has no charts: they need matplotlib (pip install ".[report]"' in proc.stderr
    assert "input     jsonl: 48 samples" in proc.stdout and "report.html" in proc.stdout, proc.stdout
    page = (out / "report.html").read_text()
    parser = ReportParser(page)
    assert not parser.svgs and "Charts need matplotlib, which is not installed" in parser.text
    assert json.loads((out / "result.json").read_text())["metrics"]["opbc/is/ess"] > 0


def test_report_shows_a_missing_key_as_not_measured(jsonl_run):
    """A key a stream did not measure is "—" on its card and has no line in the step chart, never 0 or 1."""
    _, result, _ = jsonl_run
    dense = json.loads(json.dumps(result))
    dense["metrics"].pop("moe/router/flip_rate")
    for point in dense["steps"]["points"]:
        point["metrics"].pop("moe/router/flip_rate", None)
    html = render_report({"moe": result, "dense": dense})
    card = html.split('id="card-moe-router-flip_rate"', 1)[1].split('<div class="card"', 1)[0]
    assert 'data-stream="dense">—</span>' in card
    assert f'data-stream="moe">{fmt(result["metrics"]["moe/router/flip_rate"])}</span>' in card
    chart = html.split('<svg id="chart-step-moe-router-flip_rate"', 1)[1].split("</svg>", 1)[0]
    assert 'id="chart-step-moe-router-flip_rate-series-moe"' in chart
    assert "series-dense" not in chart
    assert 'id="chart-step-opbc-is-ess-series-dense"' in html
