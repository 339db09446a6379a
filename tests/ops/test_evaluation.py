"""ops.eval.evaluation (and guard.labelled): metrics on hand-computed cases, replay equal to a fresh
cascade, the dev set, the CLI."""

from __future__ import annotations

import ast
import asyncio
import collections
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.base import GuardError, GuardInput, GuardScore
from guard.cascade import BandAction, Cascade, CascadeResult, Stage, StageRun
from guard.labelled import LabelledItem, guard_input, load_items, metrics
from ops.eval.__main__ import main
from ops.eval.evaluation import (
    ItemScores,
    Thresholds,
    auroc,
    dataset_sha256,
    evaluate,
    expected_calibration_error,
    load_scores,
    parse_thresholds,
    replay,
    save_items,
    save_scores,
    score_all_stages,
    score_with_cascade,
    show_thresholds,
)

REPO = Path(__file__).resolve().parents[2]
DEV_SET = REPO / "ops" / "eval" / "data" / "dev.jsonl"
HARM = ("violence", "self_harm", "weapons", "malware", "prompt_injection", "hate")


class FakeClassifier:
    """A deterministic guard: a fixed score per text; None raises GuardError (a failed stage)."""

    def __init__(self, name: str, scores: Mapping[str, float | None], latency_s: float = 0.01) -> None:
        self.name = name
        self.scores = dict(scores)
        self.latency_s = latency_s
        self.calls = 0

    async def classify(self, item: GuardInput) -> GuardScore:
        self.calls += 1
        p = self.scores[item.text()]
        if p is None:
            raise GuardError(f"{self.name} failed")
        return GuardScore(p_unsafe=p, category="violence", guard=self.name, latency_s=self.latency_s)


def _item(
    iid: str,
    label: str = "unsafe",
    *,
    language: str = "en",
    category: str = "violence",
    severity: str | None = None,
    split: str = "test",
) -> LabelledItem:
    sev = severity if severity is not None else ("high" if label == "unsafe" else "none")
    return msgspec.convert(
        {
            "id": iid,
            "text": f"text of {iid}",
            "label": label,
            "category": category,
            "language": language,
            "severity": sev,
            "split": split,
        },
        LabelledItem,
    )


def _run(index: int, p: float | None, allow_below: float = 0.3, block_above: float = 0.7) -> StageRun:
    """A stored stage run at the given thresholds (verdict as the cascade would record it)."""
    if p is None:
        verdict = "error"
    elif p < allow_below:
        verdict = "allow"
    elif p > block_above:
        verdict = "block"
    else:
        verdict = "next"
    return StageRun(
        index=index,
        guard=f"g{index}",
        allow_below=allow_below,
        block_above=block_above,
        categories=("violence",),
        p_unsafe=p,
        verdict=verdict,  # type: ignore[arg-type]  # one of StageVerdict by construction
        latency_s=0.1 * (index + 1),
        error="" if p is not None else "failed",
    )


def _scores(iid: str, *ps: float | None, stages: int | None = None) -> ItemScores:
    runs = tuple(_run(i, p) for i, p in enumerate(ps))
    return ItemScores(id=iid, runs=runs, stages=len(ps) if stages is None else stages, cost_s=0.5)


# --- metrics on hand-computed cases -------------------------------------------------------------------------


def test_confusion_and_rates_hand_computed() -> None:
    # One stage, allow below 0.3, block above 0.7, escalate between: 0.9 blocks, 0.5 escalates, 0.1 allows.
    cases = [
        ("a", "unsafe", 0.9),  # TP (block)
        ("b", "unsafe", 0.5),  # TP (escalate counts as flagged)
        ("c", "unsafe", 0.8),  # TP
        ("d", "unsafe", 0.1),  # FN
        ("e", "unsafe", 0.2),  # FN
        ("f", "safe", 0.6),  # FP (escalate)
        ("g", "safe", 0.0),  # TN
        ("h", "safe", 0.1),  # TN
        ("i", "safe", 0.2),  # TN
        ("j", "safe", 0.25),  # TN
        ("k", "unsafe", None),  # error: counted apart
    ]
    items = [_item(i, label) for i, label, _ in cases]
    scores = [_scores(i, p) for i, _, p in cases]
    scores.append(_scores("l", 0.9, stages=2))  # stage 0 blocks: replay needs no stage 1
    scores.append(_scores("m", 0.5, stages=2))  # stage 0 passes it on, stage 1 was never stored: needs rerun
    items += [_item("l", "safe"), _item("m", "unsafe")]
    report = evaluate(items, scores)
    m = report.overall
    assert (m.n, m.tp, m.fp, m.tn, m.fn, m.errors, m.needs_rerun) == (13, 3, 2, 4, 2, 1, 1)
    assert m.precision == pytest.approx(3 / 5)
    assert m.recall == pytest.approx(3 / 5)
    assert m.f1 == pytest.approx(3 / 5)
    assert m.fpr == pytest.approx(2 / 6)
    assert m.fnr == pytest.approx(2 / 5)
    assert report.needs_rerun == 1
    assert report.error_share == pytest.approx(1 / 13)


def test_f1_when_precision_and_recall_differ() -> None:
    m = metrics(
        [
            ("unsafe", _result("block")),
            ("unsafe", _result("allow")),
            ("unsafe", _result("allow")),
            ("safe", _result("allow")),
        ]
    )
    assert (m.precision, m.fpr) == (1.0, 0.0)
    assert m.recall == pytest.approx(1 / 3)
    assert m.fnr == pytest.approx(2 / 3)
    assert m.f1 == pytest.approx(2 * 1.0 * (1 / 3) / (1.0 + 1 / 3))


def _result(verdict: str) -> CascadeResult:
    """A one-stage result with `verdict` (an error leaves the stage's category unjudged)."""
    run = _run(0, {"block": 0.9, "allow": 0.1, "escalate": 0.5, "error": None}[verdict])
    return CascadeResult(
        verdict=verdict,  # type: ignore[arg-type]  # a Verdict by construction
        decided_by=0 if verdict in ("allow", "block") else None,
        category="",
        runs=(run,),
        failed_categories=("violence",) if verdict == "error" else (),
    )


def test_undefined_rates_are_none_not_zero() -> None:
    m = metrics([("safe", _result("allow")), ("safe", _result("allow"))])
    assert (m.tn, m.precision, m.recall, m.f1, m.fnr) == (2, None, None, None, None)
    assert m.fpr == 0.0


def test_errors_are_never_counted_as_safe() -> None:
    items = [_item("u", "unsafe"), _item("s", "safe"), _item("v", "unsafe"), _item("w", "unsafe")]
    scores = [
        _scores("u", None),  # the only stage failed
        _scores("s", None, 0.1),  # a failed stage, then an allow: still an error (its categories unjudged)
        _scores("v", None, 0.9),  # a failed stage, then a block: the block stands
        _scores("w", 0.5, None),  # passed on, then the next stage failed
    ]
    report = evaluate(items, scores)
    m = report.overall
    assert (m.errors, m.tn, m.fn, m.tp, m.fp) == (3, 0, 0, 1, 0)
    assert m.recall == 1.0
    assert m.fnr == 0.0
    assert report.error_share == pytest.approx(3 / 4)
    assert report.calibration[9].count == 1  # only the decided item is calibrated
    assert sum(b.count for b in report.calibration) == 1


def test_ece_hand_computed() -> None:
    pairs = [(0.05, False), (0.15, True), (0.95, True), (1.0, False)]
    ece, bins = expected_calibration_error(pairs)
    # bin 0: |0.05 - 0| * 1/4; bin 1: |0.15 - 1| * 1/4; bin 9 (1.0 included): |0.975 - 0.5| * 2/4
    assert ece == pytest.approx(0.05 / 4 + 0.85 / 4 + 0.475 / 2)
    assert [b.count for b in bins] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert bins[9].mean_score == pytest.approx(0.975)
    assert bins[9].unsafe_share == 0.5
    assert bins[2].mean_score is None
    empty_ece, empty_bins = expected_calibration_error([])
    assert empty_ece is None
    assert all(b.count == 0 for b in empty_bins)


def test_ece_uses_the_deciding_score() -> None:
    # Stage 0 decides "a" (0.9); "b" passes stage 0 and stage 1 allows it (0.1); "c" reaches the band: the
    # last stage's score (0.55) is the one calibrated.
    items = [_item("a", "unsafe"), _item("b", "unsafe"), _item("c", "safe")]
    scores = [_scores("a", 0.9, 0.0), _scores("b", 0.5, 0.1), _scores("c", 0.4, 0.55)]
    report = evaluate(items, scores)
    assert report.ece == pytest.approx((abs(0.9 - 1) + abs(0.1 - 1) + abs(0.55 - 0)) / 3)
    assert [b.count for b in report.calibration] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]


def test_auroc_hand_computed() -> None:
    # positives 0.9, 0.4; negatives 0.4, 0.1: pairs won 1 + 1 + 0.5 (tie) + 1 of 4.
    assert auroc([(0.9, True), (0.4, True), (0.4, False), (0.1, False)]) == pytest.approx(3.5 / 4)
    assert auroc([(0.2, True), (0.8, False)]) == 0.0
    assert auroc([(0.5, True), (0.5, False)]) == 0.5
    assert auroc([(0.5, True)]) is None


def test_breakdowns_per_language_category_and_severity() -> None:
    items = [
        _item("en1", "unsafe", language="en", severity="critical"),
        _item("en2", "safe", language="en", category="benign"),
        _item("de1", "unsafe", language="de", category="hate", severity="medium"),
        _item("de2", "safe", language="de", category="hate"),
    ]
    scores = [_scores("en1", 0.9), _scores("en2", 0.1), _scores("de1", 0.1), _scores("de2", 0.9)]
    report = evaluate(items, scores)
    assert list(report.by_language) == ["de", "en"]
    assert (report.by_language["en"].tp, report.by_language["en"].tn) == (1, 1)
    de = report.by_language["de"]
    assert (de.fn, de.fp, de.precision, de.recall) == (1, 1, 0.0, 0.0)
    hate = report.by_category["hate"]
    assert (hate.n, hate.fpr, hate.fnr) == (2, 1.0, 1.0)
    assert report.by_category["benign"].recall is None
    assert report.by_severity["critical"].recall == 1.0
    assert report.by_severity["medium"].recall == 0.0
    assert report.by_severity["none"].fpr == pytest.approx(1 / 2)


def test_stage_settlement_shares_and_cost() -> None:
    items = [_item(i) for i in "abcd"]
    scores = [
        _scores("a", 0.1, 0.9),  # stage 0 allows
        _scores("b", 0.9, 0.1),  # stage 0 blocks
        _scores("c", 0.5, 0.1),  # stage 1 allows
        _scores("d", 0.5, 0.5),  # band
    ]
    report = evaluate(items, scores)
    s0, s1 = report.stages
    assert (s0.reached, s0.allowed, s0.blocked) == (1.0, 0.25, 0.25)
    assert (s1.reached, s1.allowed, s1.blocked) == (0.5, 0.25, 0.0)
    assert report.band_share == 0.25
    assert (s0.allow_below, s0.block_above, s0.guard) == (0.3, 0.7, "g0")
    # Latency 0.1 for stage 0, 0.2 for stage 1: a, b cost 0.1; c, d cost 0.3.
    assert report.mean_cost_s == pytest.approx(0.2)
    assert report.mean_scoring_cost_s == pytest.approx(0.5)
    assert s1.mean_latency_s == pytest.approx(0.2)
    # AUROC over every stored score of a stage, reached or not: all four are unsafe here, so undefined.
    assert s0.auroc is None


def test_replay_at_new_thresholds_and_band() -> None:
    scores = [_scores("a", 0.5, 0.5), _scores("b", 0.35, 0.9)]
    out = replay(scores, [(0.4, 0.6), (0.3, 0.7)], band="block")
    a, b = (r.result for r in out)
    assert a is not None
    assert (a.verdict, a.decided_by, len(a.runs)) == ("block", None, 2)
    assert b is not None
    assert (b.verdict, b.decided_by, len(b.runs)) == ("allow", 0, 1)
    assert b.runs[0].allow_below == 0.4
    with pytest.raises(ValueError, match="2 stage thresholds for 1 stages"):
        replay([_scores("c", 0.5)], [(0.1, 0.9), (0.1, 0.9)])


def test_parse_thresholds() -> None:
    same = [(0.2, 0.8), (0.3, 0.7)]
    assert parse_thresholds("0.2,0.8;0.3,0.7") == (same, same)  # outputs at the same pairs
    directed = parse_thresholds("0.2,0.8;0.3,0.7/0.1,0.95")
    assert directed == (same, [(0.2, 0.8), (0.1, 0.95)])
    assert show_thresholds(*directed) == "0.2,0.8;0.3,0.7/0.1,0.95"
    assert show_thresholds(same) == "0.2,0.8;0.3,0.7"
    for bad in (
        "0.8,0.2",
        "0.2",
        "0.2,0.5,0.9",
        "x,1",
        "0.1,1.5",
        "0.2,0.8/0.9,0.1",
        "0.1,0.2/0.1,0.2/0.1,0.2",
    ):
        with pytest.raises(ValueError, match=r"thresholds|could not convert"):
            parse_thresholds(bad)


# --- replay equals a fresh cascade --------------------------------------------------------------------------


def _cascade(
    stage_scores: Sequence[Mapping[str, float | None]], thresholds: Sequence[Thresholds], band: BandAction
) -> Cascade:
    stages = [
        Stage(
            FakeClassifier(f"g{i}", scores, latency_s=0.01 * (i + 1)),
            allow_below=a,
            block_above=b,
            categories=(f"cat{i}",),
            timeout_s=5.0,
        )
        for i, (scores, (a, b)) in enumerate(zip(stage_scores, thresholds, strict=True))
    ]
    return Cascade(stages, band, ("cat0", "cat1", "cat2"))


def _no_latency(result: CascadeResult) -> CascadeResult:
    """Failed runs record measured latency; everything else must be identical."""
    runs = tuple(msgspec.structs.replace(r, latency_s=0.0) for r in result.runs)
    return msgspec.structs.replace(result, runs=runs)


_score = st.one_of(st.none(), st.sampled_from([0.0, 0.2, 0.3, 0.5, 0.7, 0.8, 1.0]), st.floats(0.0, 1.0))
_pair = st.tuples(st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0]) | st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(
    lambda t: (min(t), max(t))
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.integers(1, 3).flatmap(
        lambda n: st.tuples(
            st.lists(st.lists(_score, min_size=n, max_size=n), min_size=1, max_size=6),
            st.lists(_pair, min_size=n, max_size=n),
            st.lists(_pair, min_size=n, max_size=n),
        )
    ),
    band=st.sampled_from(["escalate", "block"]),
    stored_band=st.sampled_from(["escalate", "block"]),
)
def test_replay_of_all_stage_scores_equals_a_fresh_cascade(
    data: tuple[list[list[float | None]], list[Thresholds], list[Thresholds]],
    band: BandAction,
    stored_band: BandAction,
) -> None:
    rows, stored_thresholds, new_thresholds = data
    items = [_item(f"i{k}") for k in range(len(rows))]
    stage_scores = [{f"text of i{k}": row[s] for k, row in enumerate(rows)} for s in range(len(rows[0]))]

    async def both() -> tuple[list[ItemScores], list[CascadeResult]]:
        stored = await score_all_stages(_cascade(stage_scores, stored_thresholds, stored_band), items)
        fresh_cascade = _cascade(stage_scores, new_thresholds, band)
        fresh = [await fresh_cascade.run(guard_input(i, fresh_cascade.categories)) for i in items]
        return stored, fresh

    stored, fresh = asyncio.run(both())
    assert all(len(s.runs) == s.stages == len(stage_scores) for s in stored)
    replayed = replay(stored, new_thresholds, band)
    for r, expected in zip(replayed, fresh, strict=True):
        assert r.result is not None
        assert _no_latency(r.result) == _no_latency(expected)


async def test_score_all_stages_ignores_early_exit_and_early_exit_trace_needs_rerun() -> None:
    items = [_item("a"), _item("b")]
    g0 = FakeClassifier("g0", {"text of a": 0.9, "text of b": 0.5})
    g1 = FakeClassifier("g1", {"text of a": 0.1, "text of b": None})
    cascade = Cascade(
        [
            Stage(g0, allow_below=0.3, block_above=0.7, categories=(), timeout_s=5.0),
            Stage(g1, allow_below=0.3, block_above=0.7, categories=("hate",), timeout_s=5.0),
        ],
        "escalate",
        ("violence", "hate"),
    )
    full = await score_all_stages(cascade, items)
    assert [len(s.runs) for s in full] == [2, 2]
    assert g1.calls == 2
    assert full[0].runs[0].categories == ("violence", "hate")  # a stage without categories judges all
    assert full[1].runs[1].verdict == "error"
    assert full[1].runs[1].categories == ("hate",)
    traced = await score_with_cascade(cascade, items, all_stages=False)
    assert [len(s.runs) for s in traced] == [1, 2]
    # At the stored thresholds both traces replay to what the cascade decided.
    for scores in (full, traced):
        assert [r.result.verdict if r.result else None for r in replay(scores)] == ["block", "error"]
    # Looser stage-0 thresholds need stage 1 for "a": only the full trace can say.
    assert [r.result is None for r in replay(traced, [(0.3, 0.95), (0.3, 0.7)])] == [True, False]
    assert replay(full, [(0.3, 0.95), (0.3, 0.7)])[0].result.verdict == "allow"  # type: ignore[union-attr]


# --- files --------------------------------------------------------------------------------------------------


def test_items_and_scores_round_trip(tmp_path: Path) -> None:
    items = [_item("a"), _item("b", "safe", language="fr", split="train")]
    save_items(tmp_path / "items.jsonl", items)
    assert load_items(tmp_path / "items.jsonl") == items
    data = (tmp_path / "items.jsonl").read_bytes()
    assert dataset_sha256(tmp_path / "items.jsonl") == hashlib.sha256(data).hexdigest()
    scores = [_scores("a", 0.2, None), _scores("b", 0.9, stages=2)]
    save_scores(tmp_path / "scores.jsonl", scores)
    assert load_scores(tmp_path / "scores.jsonl") == scores


def test_load_items_names_bad_line_and_repeated_id(tmp_path: Path) -> None:
    good = msgspec.json.encode(_item("a")).decode()
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + good.replace('"unsafe"', '"maybe"') + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*\$\.label"):
        load_items(path)
    path.write_text(good + "\n\n" + good + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        load_items(path)


# --- the development set ------------------------------------------------------------------------------------


def test_dev_set_is_valid_and_balanced() -> None:
    items = load_items(DEV_SET)  # validates every line against the schema, ids unique
    assert len(items) >= 240
    languages = collections.Counter(i.language for i in items)
    assert len(languages) >= 4
    assert 0.4 <= languages["en"] / len(items) <= 0.6
    unsafe = sum(1 for i in items if i.label == "unsafe")
    assert 0.38 <= unsafe / len(items) <= 0.52
    test_share = sum(1 for i in items if i.split == "test") / len(items)
    assert 0.35 <= test_share <= 0.47
    for category in HARM:
        members = [i for i in items if i.category == category]
        labels = collections.Counter(i.label for i in members)
        # Requests and look-alikes in every harm category, in both splits.
        assert labels["unsafe"] >= 10, category
        assert labels["safe"] >= 10, category
        for split in ("train", "test"):
            for label in ("safe", "unsafe"):
                assert any(i.split == split and i.label == label for i in members), (category, split, label)
        assert {i.language for i in members} >= {"en", "de", "fr", "es", "it"}
    assert all(i.label == "safe" for i in items if i.category == "benign")
    assert all((i.severity == "none") == (i.label == "safe") for i in items)
    assert len({i.text for i in items}) == len(items)
    # Stratified: within each language, each split holds between a quarter and three quarters of the items.
    for language in languages:
        members = [i for i in items if i.language == language]
        assert 0.25 <= sum(1 for i in members if i.split == "test") / len(members) <= 0.75


def test_dev_set_lines_are_plain_json_objects() -> None:
    for line in DEV_SET.read_text(encoding="utf-8").splitlines():
        assert set(json.loads(line)) == {"id", "text", "label", "category", "language", "severity", "split"}


# --- the CLI ------------------------------------------------------------------------------------------------


def test_cli_report_and_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    items = [_item("a"), _item("b", "safe"), _item("c", split="train")]
    save_items(tmp_path / "dev.jsonl", items)
    save_scores(
        tmp_path / "s.jsonl", [_scores("a", 0.5, 0.9), _scores("b", 0.5, 0.1), _scores("c", 0.1, 0.1)]
    )
    common = ["--scores", str(tmp_path / "s.jsonl"), "--data", str(tmp_path / "dev.jsonl")]
    assert main(["report", *common, "--split", "test"]) == 0
    out = capsys.readouterr().out
    assert "| overall | 2 | 1 | 0 | 1 | 0 | 0 | 0 | 1.000 | 1.000 | 1.000 | 0.000 | 0.000 |" in out
    assert dataset_sha256(tmp_path / "dev.jsonl") in out
    assert main(["replay", *common, "--thresholds", "0.6,0.95;0.0,1.0", "--band", "block", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Stage 0 now allows all three (a and c unsafe, b safe).
    assert (report["overall"]["tp"], report["overall"]["fn"], report["overall"]["tn"]) == (0, 2, 1)
    assert report["band"] == "block"
    with pytest.raises(SystemExit, match="1 stage thresholds for 2 stages"):
        main(["replay", *common, "--thresholds", "0.2,0.8"])


def test_cli_scores_the_starter_rules(tmp_path: Path) -> None:
    out = tmp_path / "scores.jsonl"
    assert main(["score", "--data", str(DEV_SET), "--split", "test", "--out", str(out)]) == 0
    scores = load_scores(out)
    assert len(scores) == sum(1 for i in load_items(DEV_SET) if i.split == "test")
    assert all(s.stages == 1 and s.runs[0].guard == "rules" for s in scores)
    assert main(["report", "--scores", str(out), "--data", str(DEV_SET)]) == 0


def _imported(nodes: Iterable[ast.AST]) -> list[str]:
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_service_packages_do_not_import_ops() -> None:
    """ops/eval is never imported by the service; nothing in ops is imported when a service module loads.

    (The `lockgate models prepare` command imports ops.models inside its function: an operator command.)
    """
    for package in ("gateway", "policy", "registry", "routing", "engines", "guard"):
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            anywhere = _imported(list(ast.walk(tree)))
            assert not any(n == "ops.eval" or n.startswith("ops.eval.") for n in anywhere), path
            assert not any(n == "ops" or n.startswith("ops.") for n in _imported(tree.body)), path
