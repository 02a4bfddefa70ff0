"""The benchmark suite and leaderboard: suite validation, records, equal-budget merging,
rendering (Markdown, HTML, plots), the CLI, and a headless-browser look at the HTML page.

The records these tests merge and render come from real suite runs on ContrastLab (the
simulator's fast path), made once per module by ``trace-gym leaderboard run``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml


from trace_gym.cli.main import main
from trace_gym.leaderboard import (
    RecordError, SuiteError, UnequalBudget, load_records, load_suite, parse_suite, rank,
)
from trace_gym.leaderboard.records import EvalPoint, compute_digest
from trace_gym.provenance import KERNEL_ENV_VARS, cpu_info

ALLOCATORS = ["grpo", "uniform", "trace"]
M, CANDIDATES, STEPS = 256, 128, 4


def suite_dict(name: str = "small", *, seeds=(0, 1), steps: int = STEPS, allocators=ALLOCATORS, trajectories: int = M,
               training: bool = False) -> dict:
    tracks = [{
        "name": "contrastlab", "kind": "allocation", "envs": ["trace_gym/ContrastLab-v0"],
        "policy": {"name": "sim"}, "allocators": list(allocators),
        "budget": {"trajectories": trajectories, "prompts": CANDIDATES}, "steps": steps,
    }]
    if training:  # ContrastLab's learning mode: a training track that runs in seconds
        tracks.append({
            "name": "learning", "kind": "training", "envs": ["trace_gym/ContrastLab-v0"], "policy": {"name": "sim"},
            "allocators": ["grpo", "trace", {"name": "trace", "advantage": "trace:scale=group"}],
            "budget": {"trajectories": trajectories, "prompts": CANDIDATES}, "steps": steps, "trainer": {"overrides": {"model.sim_shared_lr": 1.0}},
            "eval": {"split": "test", "tasks": 128, "k": 4, "every": 2},
        })
    return {"suite": name, "description": "ContrastLab at a small budget, for tests", "seeds": list(seeds), "tracks": tracks}


def run_cli(*argv: str) -> int:
    return main(["leaderboard", *map(str, argv)])


def write_suite(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Real runs: A (seeds 0, 1), B (seed 2, same budget), C (seed 5, one step fewer)."""
    root = tmp_path_factory.mktemp("lb")
    out = {}
    for name, kw in {"a": {"training": True}, "b": {"seeds": (2,)}, "c": {"seeds": (5,), "steps": STEPS - 1, "allocators": ["grpo"]}}.items():
        suite = write_suite(root / f"{name}.yaml", suite_dict(f"small-{name}", **kw))
        assert run_cli("run", suite, "--out", root / name, "--no-progress") == 0
        out[name] = root / name
    return out


# ----------------------------------------------------------------------------- a run


def test_run_writes_records_leaderboard_and_plots(runs):
    a = runs["a"]
    for f in ("records.jsonl", "leaderboard.md", "leaderboard.html", "effective_ratio.png", "accuracy_vs_budget.png"):
        assert (a / f).is_file(), f
    records = [lr.record for lr in load_records([a]) if lr.record.kind == "allocation"]
    assert sorted((r.allocator, r.seed) for r in records) == sorted((x, s) for x in ALLOCATORS for s in (0, 1))
    for r in records:
        # every row spent exactly the budget: M trajectories in each of the steps
        assert r.spent.trajectories == M * STEPS
        assert [s.trajectories for s in r.steps] == [M] * STEPS
        assert r.spent.tokens == sum(s.tokens for s in r.steps) > 0
        for s in r.steps:
            assert 0.0 <= s.metrics["effective_ratio"] <= 1.0
            assert 0.0 <= s.metrics["effective_sample_ratio"] <= 1.0
            # calibration of the allocator's own predictor (trace: hashed; grpo/uniform: none)
            if r.allocator == "trace":
                assert r.predictor == "hashed" and 0.0 <= s.metrics["brier"] <= 1.0 and 0.0 <= s.metrics["auc"] <= 1.0
            else:
                assert r.predictor is None and s.metrics["brier"] is None
        assert r.final["effective_ratio"] == pytest.approx(np.mean([s.metrics["effective_ratio"] for s in r.steps]))
        assert r.git_commit and r.versions["numpy"] == np.__version__ and len(r.config_hash) == 16
        assert r.cpu == cpu_info() and r.cpu["cpu"]  # math libraries choose kernels by CPU
    assert f"CPU(s) {cpu_info()['cpu']}" in (a / "leaderboard.html").read_text()
    # the same seed offers every allocator the same prompts, so grpo's fixed groups see the
    # same per-step prompt count whatever ran before it
    by = {(r.allocator, r.seed): r for r in records}
    assert by[("grpo", 0)].steps[0].metrics["prompts"] == M // 8
    # how often a branch in a tree whose root rollouts agreed flipped it: trees only
    for seed in (0, 1):
        flips = [s.metrics["branch_flip_rate"] for s in by[("trace", seed)].steps if s.metrics["branch_flip_rate"] is not None]
        assert flips and by[("trace", seed)].final["branch_flip_rate"] == pytest.approx(np.mean(flips))
        assert by[("grpo", seed)].final["branch_flip_rate"] is None
        # stage 2's calibration per step: trace continues pure prompts; grpo's groups have nothing before them
        seen = [(s.metrics["root_disagree_pred"], s.metrics["root_disagree_seen"]) for s in by[("trace", seed)].steps
                if s.metrics["root_disagree_seen"] is not None]
        assert seen and all(0.0 <= p <= 1.0 and 0.0 <= q <= 1.0 for p, q in seen)
        assert all(s.metrics["root_disagree_seen"] is None and s.metrics["inner_disagree_seen"] is None
                   for s in by[("grpo", seed)].steps)
    md = (a / "leaderboard.md").read_text()
    assert "| branch flips |" in md and "branch flips: of the branches in trees whose rollouts from the root all agreed" in md


def test_training_track_records_accuracy_against_spend(runs):
    records = [lr.record for lr in load_records([runs["a"]]) if lr.record.kind == "training"]
    scaled = "trace[adv=trace:scale=group]"  # an entry with its own advantage estimator is its own row
    assert sorted((r.allocator, r.seed) for r in records) == [("grpo", 0), ("grpo", 1), ("trace", 0), ("trace", 1),
                                                               (scaled, 0), (scaled, 1)]
    from trace_gym.run import defaults

    own_trace = str(defaults("trace")[1])  # the allocator's own estimator, unless the entry sets one
    assert {r.allocator: r.advantage for r in records} == {"grpo": "grpo", "trace": own_trace, scaled: "trace:scale=group"}
    for r in records:
        assert [e.step for e in r.evals] == [0, 2, 4]
        assert [e.trajectories for e in r.evals] == [0, 2 * M, 4 * M] and r.evals[-1].tokens == r.spent.tokens
        assert r.final["accuracy"] == r.evals[-1].accuracy
        assert r.final["accuracy_gain"] == pytest.approx(r.evals[-1].accuracy - r.evals[0].accuracy)
        # the simulated policy learns: held-out accuracy rises over the run
        assert r.evals[-1].accuracy > r.evals[0].accuracy
    # the starting policy is the same for every allocator of a seed; the scaled advantage
    # updates the policy differently from the plain one
    assert len({(r.seed, r.evals[0].accuracy) for r in records}) == 2
    final = {(r.allocator, r.seed): r.evals[-1].accuracy for r in records}
    assert final[("trace", 0)] != final[(scaled, 0)]
    groups = rank(load_records([runs["a"]]))
    assert [g.kind for g in groups] == ["allocation", "training"]
    acc = [row.mean["accuracy"] for row in groups[1].rows]
    assert acc == sorted(acc, reverse=True)


def test_ranking_follows_effective_sample_ratio(runs):
    group = rank(load_records([runs["a"]]))[0]
    esr = [row.mean["effective_sample_ratio/grpo"] for row in group.rows]  # ranked under one named estimator
    assert esr == sorted(esr, reverse=True)
    assert [row.rank for row in group.rows] == [1, 2, 3]
    md = (runs["a"] / "leaderboard.md").read_text()
    lines = [l for l in md.split("## ")[1].splitlines() if l.startswith("| ")]
    assert lines[0].startswith("| rank | allocator | seeds | eff. sample ratio")
    assert [l.split("|")[2].strip() for l in lines[1:]] == [row.allocator for row in group.rows]


def test_contrastlab_rows_share_one_evaluation_set_roots_and_prefixes_apart(tmp_path):
    """Two allocators with predictors on ContrastLab are scored, like the bench, on the same
    evaluation set (the same nodes of each seed), roots and prefixes reported apart; the
    table shows these columns, not the own-node figures, and names the Bayes-optimal AUC."""
    from trace_gym.sim.evaluation import evaluation_set
    from trace_gym.sim.world import ContrastLabWorld

    suite = write_suite(tmp_path / "s.yaml", suite_dict("shared", seeds=(0, 1), steps=2, allocators=["trace", "pcl", "grpo"]))
    assert run_cli("run", suite, "--out", tmp_path / "out", "--no-progress") == 0
    records = [lr.record for lr in load_records([tmp_path / "out"])]
    for seed in (0, 1):
        es = evaluation_set(ContrastLabWorld(seed=seed))  # the set the bench would build for this world
        finals = {r.allocator: r.final for r in records if r.seed == seed}
        assert set(finals) == {"trace", "pcl", "grpo"}
        for f in finals.values():  # the same nodes for every row, a predictor or none
            assert (f["eval_roots"], f["eval_prefixes"]) == (es.roots.size, es.prefixes.size)
            assert f["bayes_auc_prefix"] == pytest.approx(es.references()["bayes"]["prefixes"]["auc"])
            assert not {"auc", "brier", "ece"} & set(f)  # own-node figures stay in the steps only
        for name in ("trace", "pcl"):
            f = finals[name]
            assert 0.5 < f["auc_prefix"] <= 1.0 and 0.5 < f["auc_root"] <= 1.0
            assert 0.0 <= f["brier_prefix"] <= 1.0 and 0.0 <= f["brier_root"] <= 1.0
            assert f["auc_prefix"] != f["auc_root"]
        assert finals["trace"]["auc_prefix"] != finals["pcl"]["auc_prefix"]
        assert finals["grpo"]["auc_prefix"] is None and finals["grpo"]["auc_root"] is None
    assert all(s.metrics["auc"] is not None for r in records if r.allocator == "trace" for s in r.steps)
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| rank"))
    assert "AUC prefixes (eval set)" in head and "AUC roots (eval set)" in head and "Brier prefixes (eval set) ↓" in head
    assert "own nodes" not in head
    assert "eval set: one per seed, shared by every row" in md and "Bayes-optimal AUC on it" in md


def test_own_node_calibration_is_labelled_as_such(runs):
    """Records whose calibration is over the nodes each row chose (other envs; ContrastLab
    records written before the shared evaluation set) still load and render, under headers
    that say so."""
    from trace_gym.leaderboard.records import make_record
    from trace_gym.leaderboard.render import render_markdown

    old = []
    for lr in load_records([runs["b"]]):
        data = lr.record.model_dump(mode="python")
        for k in ("schema_", "created", "digest"):
            data.pop(k)
        final = {k: v for k, v in data["final"].items() if not k.startswith(("auc_", "brier_", "bayes_", "eval_"))}
        data["final"] = {**final, "brier": 0.2, "ece": 0.05, "auc": 0.9 if lr.record.predictor else None}
        old.append(type(lr)(make_record(**data), lr.where))
    md = render_markdown(rank(old))
    head = next(line for line in md.splitlines() if line.startswith("| rank"))
    assert "AUC (own nodes)" in head and "Brier (own nodes) ↓" in head and "eval set" not in head
    assert "do not compare between rows" in md and "Bayes-optimal" not in md


def test_training_tables_count_the_prompts_sampled_and_those_that_mixed(runs):
    """A training table shows each row's prompts a step and how many of them mixed, from the
    steps of any record (these finals are not stored): a row that samples fewer prompts or
    mixes fewer of them shows it, and a step that records neither is left out, not zeroed."""
    from trace_gym.leaderboard.records import make_record
    from trace_gym.leaderboard.render import render_markdown

    loaded = [lr for lr in load_records([runs["a"]]) if lr.record.kind == "training"]
    edited = []
    for lr in loaded:
        data = lr.record.model_dump(mode="python")
        for k in ("schema_", "created", "digest"):
            data.pop(k)
        for i, s in enumerate(data["steps"]):
            if lr.record.allocator == "trace":  # 10 prompts a step, 3, 4, 5, ... of them mixed
                s["metrics"]["prompts"], s["metrics"]["effective_ratio"] = 10.0, (3 + i) / 10
            if lr.record.allocator == "grpo" and i == 0:  # a step that recorded no prompt count
                s["metrics"]["prompts"] = None
        edited.append(type(lr)(make_record(**data), lr.where))
    (group,) = rank(edited)
    rows = {row.allocator: row for row in group.rows}
    assert rows["trace"].mean["prompts"] == 10.0
    assert rows["trace"].mean["mixed_prompts"] == pytest.approx(np.mean([3 + i for i in range(STEPS)]))
    grpo = [lr.record for lr in loaded if lr.record.allocator == "grpo"]
    expected = np.mean([np.mean([round(s.metrics["prompts"] * s.metrics["effective_ratio"]) for s in r.steps[1:]])
                        for r in grpo])
    assert rows["grpo"].mean["mixed_prompts"] == pytest.approx(expected) and 0 < expected <= M // 8
    md = render_markdown([group])
    head, rule, *body = [line for line in md.splitlines() if line.startswith("|")]
    cells = {cols[2]: cols for cols in ([c.strip() for c in line.split("|")] for line in body)}
    i = head.split("|").index(" mixed prompts/step ")
    assert cells["trace"][i] == f"{np.mean([3 + j for j in range(STEPS)]):.2f} ± 0.00"
    assert head.split("|")[i - 1].strip() == "prompts/step" and cells["trace"][i - 1] == "10.00 ± 0.00"
    assert "mixed prompts/step: of them, those whose tree holds both a success and a failure" in md


def test_per_task_scores_give_the_evaluations_own_noise_on_a_paired_difference(runs, tmp_path):
    """Training records that keep their final evaluation's per-task scores get, against a
    row, the 95% half-width that the evaluation alone puts on the accuracy difference (the
    tasks paired, the seeds' variances added): a reader sees whether a gap on a seed or two is
    one the evaluation can tell from zero. Scores that do not fit their evaluation (another
    task count, another mean) are refused by field; records without them show no such column."""
    from trace_gym.leaderboard.paired import EVAL_NOISE, eval_noise, paired, paired_table
    from trace_gym.leaderboard.records import make_record
    from trace_gym.leaderboard.render import render_markdown

    loaded = [lr for lr in load_records([runs["a"]]) if lr.record.kind == "training" and lr.record.allocator in ("grpo", "trace")]
    (plain,) = rank(loaded)
    assert EVAL_NOISE not in paired_table(plain, "grpo")[0]  # ContrastLab's exact evaluation: nothing to pair
    assert all("task_scores" not in line for line in (runs["a"] / "records.jsonl").read_text().splitlines())

    def with_scores(lr, s):
        data = lr.record.model_dump(mode="python")
        for k in ("schema_", "created", "digest"):
            data.pop(k)
        data["evals"][-1].update(task_scores=s, accuracy=float(np.mean(s)))
        data["final"]["accuracy"] = float(np.mean(s))
        return type(lr)(make_record(**data), lr.where)

    rng = np.random.default_rng(0)
    scores = {}
    for lr in loaded:
        p = 0.8 if lr.record.allocator == "grpo" else 0.7
        scores[lr.record.allocator, lr.record.seed] = (rng.binomial(4, p, size=lr.record.evals[-1].tasks) / 4).tolist()  # k = 4
    edited = [with_scores(lr, scores[lr.record.allocator, lr.record.seed]) for lr in loaded]
    (group,) = rank(edited)
    (trace,) = paired(group, "grpo")
    var = [np.var(np.subtract(scores["trace", seed], scores["grpo", seed]), ddof=1) / len(scores["grpo", seed]) for seed in (0, 1)]
    assert trace.eval_noise == pytest.approx(1.959964 * np.sqrt(sum(var)) / 2)
    assert trace.eval_noise == pytest.approx(eval_noise([scores["trace", s] for s in (0, 1)], [scores["grpo", s] for s in (0, 1)]))
    assert 0.01 < trace.eval_noise < 0.1  # 128 tasks, k = 4: a few points
    head, (cells,) = paired_table(group, "grpo")
    assert head[3] == EVAL_NOISE and cells[3] == f"± {trace.eval_noise:.3f}"
    md = render_markdown([group], against="grpo")
    assert "eval noise: the 95% half-width that the held-out evaluation's own sampling puts on" in md
    # one seed of the baseline without scores: no figure for the row
    (half,) = rank([lr for lr in edited if (lr.record.allocator, lr.record.seed) != ("grpo", 1)] +
                   [lr for lr in loaded if (lr.record.allocator, lr.record.seed) == ("grpo", 1)])
    assert paired(half, "grpo")[0].eval_noise is None
    with pytest.raises(ValueError, match="the same tasks"):
        eval_noise([[0.5, 1.0]], [[0.5]])
    # rows that agree on every task leave no spread to estimate the noise from: n/a, not ± 0.000
    assert np.isnan(eval_noise([scores["grpo", 0]], [scores["grpo", 0]]))
    assert eval_noise([scores["grpo", 0], scores["trace", 1]], [scores["grpo", 0], scores["grpo", 1]]) > 0  # one seed's spread is enough
    (same,) = rank([with_scores(lr, scores["grpo", lr.record.seed]) for lr in loaded])
    (agree,) = paired(same, "grpo")
    assert agree.metric_diff == [0.0, 0.0] and np.isnan(agree.eval_noise)
    assert paired_table(same, "grpo")[1][0][3] == "n/a" and "(n/a: the per-task differences do not vary" in render_markdown([same], against="grpo")

    line = edited[0].record.model_dump(mode="json", by_alias=True)
    last = edited[0].record.evals[-1]
    assert EvalPoint.scores_problem(last.task_scores, last.tasks, last.accuracy) is None  # what a runner asks first
    for bad, problem in (({"task_scores": line["evals"][-1]["task_scores"][:-1]}, "127 scores for 128 tasks"),
                         ({"accuracy": line["evals"][-1]["accuracy"] + 0.01}, "is not the accuracy")):
        d = json.loads(json.dumps(line))
        d["evals"][-1].update(bad)
        d["digest"] = compute_digest(d)
        (tmp_path / "records.jsonl").write_text(json.dumps(d) + "\n")
        with pytest.raises(RecordError, match=re.escape(f"evals[{len(d['evals']) - 1}].task_scores") + ".*" + problem):
            load_records([tmp_path])


def test_training_rows_of_a_seed_evaluated_on_different_held_out_sets_are_refused(runs, tmp_path, capsys):
    """Held-out accuracy compares only on the same tasks sampled as often: a training row
    evaluated on fewer tasks, or with another k, than the other rows of its seed is refused by
    name, and `show --seeds` can still show the seeds where they agree."""
    from trace_gym.leaderboard.records import make_record, write_records

    loaded = [lr for lr in load_records([runs["a"]]) if lr.record.kind == "training"]
    edited = []
    for lr in loaded:
        r = lr.record
        if (r.allocator, r.seed) == ("grpo", 1):  # grpo's seed 1 evaluated with k = 1 on 64 tasks
            data = r.model_dump(mode="python")
            for k in ("schema_", "created", "digest"):
                data.pop(k)
            data["evals"][-1].update(k=1, tasks=64)
            r = make_record(**data)
        edited.append(r)
    write_records(tmp_path / "records.jsonl", edited)
    with pytest.raises(UnequalBudget) as exc:
        rank(load_records([tmp_path]))
    msg = str(exc.value)
    assert "different held-out sets" in msg and "seed 0" not in msg
    assert "seed 1: 64 tasks x k = 1: grpo" in msg and "seed 1: 128 tasks x k = 4: trace" in msg
    assert run_cli("show", tmp_path) == 1 and "different held-out sets" in capsys.readouterr().err
    assert run_cli("show", tmp_path, "--seeds", "0") == 0
    rank(load_records([runs["a"]]))  # as run: every row of a seed evaluated alike


def test_equal_scores_share_a_rank(runs, tmp_path):
    lines = (runs["b"] / "records.jsonl").read_text().splitlines()
    tied = []
    for line in lines:  # a hand-made tie, resealed: every allocator scores 0.5
        d = json.loads(line)
        d["final"]["effective_sample_ratio"] = d["final"]["effective_sample_ratio/grpo"] = 0.5
        d["digest"] = compute_digest(d)
        tied.append(json.dumps(d))
    (tmp_path / "records.jsonl").write_text("\n".join(tied) + "\n")
    (group,) = rank(load_records([tmp_path]))
    assert [row.rank for row in group.rows] == [1, 1, 1]


def test_html_is_self_contained_with_table_and_embedded_plots(runs):
    page = (runs["a"] / "leaderboard.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*['"](https?:|//|file:)""", page)
    imgs = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert [base64.b64decode(i) for i in imgs] == [(runs["a"] / f).read_bytes()
                                                   for f in ("effective_ratio.png", "accuracy_vs_budget.png")]
    for name in ALLOCATORS:
        assert f"<td class='alloc'>{name}</td>" in page


def test_resume_skips_finished_runs_and_keeps_stale_ones(runs, tmp_path):
    shutil.copytree(runs["a"], tmp_path / "a")
    before = (tmp_path / "a" / "records.jsonl").read_text()
    suite = write_suite(tmp_path / "s.yaml", suite_dict("small-a", training=True))
    assert run_cli("run", suite, "--out", tmp_path / "a", "--no-progress") == 0
    assert (tmp_path / "a" / "records.jsonl").read_text() == before
    # the suite changed (one step more, no training track): every row is run again at the new
    # budget and the leaderboard ranks the new ones only; the old records are kept beside them
    suite = write_suite(tmp_path / "s.yaml", suite_dict("small-a", steps=STEPS + 1))
    assert run_cli("run", suite, "--out", tmp_path / "a", "--no-progress") == 0
    records = [lr.record for lr in load_records([tmp_path / "a"])]
    assert len(records) == len(ALLOCATORS) * 2 and {r.spent.trajectories for r in records} == {M * (STEPS + 1)}
    earlier = (tmp_path / "a" / "records.earlier.jsonl").read_text().splitlines()
    assert sorted(earlier) == sorted(before.splitlines())
    assert "records.earlier.jsonl" in (tmp_path / "a" / "leaderboard.md").read_text()
    assert not (tmp_path / "a" / "accuracy_vs_budget.png").exists()


def test_a_log_file_gets_one_line_per_step_where_a_terminal_gets_bars(tmp_path):
    """``nohup trace-gym leaderboard run ... > log``: rich draws no bars off a terminal, so a
    long row would log nothing until it ends; each finished step is a line there instead."""
    import io

    from rich.console import Console

    from trace_gym.leaderboard.runner import run_suite

    spec = parse_suite(suite_dict("small-log", seeds=(0,), steps=2, allocators=["grpo", "trace"], trajectories=64))
    log = io.StringIO()
    run_suite(spec, tmp_path / "a", console=Console(file=log, width=200))
    lines = [line for line in log.getvalue().splitlines() if "step " in line]
    assert [re.sub(r" \(\d+ s\)$", "", line) for line in lines] == [
        f"{label}: step {k}/2 done" for label in ("contrastlab / ContrastLab-v0 / grpo / seed 0", "contrastlab / ContrastLab-v0 / trace / seed 0")
        for k in (1, 2)]
    quiet = io.StringIO()
    run_suite(spec, tmp_path / "b", console=Console(file=quiet, width=200), show_progress=False)
    assert "step " not in quiet.getvalue()


# ----------------------------------------------------------------------------- show / merge


def test_show_prints_the_ranked_table(runs, capsys):
    assert run_cli("show", runs["a"]) == 0
    out = capsys.readouterr().out
    assert "ContrastLab-v0" in out and all(a in out for a in ALLOCATORS)
    assert "trace[adv=trace:scale=group]" in out  # brackets in a row name are printed, not read as markup


def test_show_against_a_row_pairs_the_rows_by_seed(runs, tmp_path, capsys):
    from trace_gym.leaderboard.cli import _only
    from trace_gym.leaderboard.paired import paired, tokens_to_reach

    # B ran every row on seed 2; keep only its grpo and trace records: merged with A, uniform
    # then lacks seed 2 and the merge is refused, until --allocators leaves uniform out
    b_lines = (runs["b"] / "records.jsonl").read_text().splitlines()
    part = tmp_path / "b-part.jsonl"
    part.write_text("\n".join(l for l in b_lines if json.loads(l)["allocator"] in ("grpo", "trace")) + "\n")
    assert run_cli("show", runs["a"], part) == 1
    capsys.readouterr()
    assert run_cli("show", runs["a"], part, "--allocators", "grpo,trace", "--against", "grpo") == 0
    out = capsys.readouterr().out
    assert out.count("against grpo, paired by seed") == 2  # the allocation and the training group
    assert "uniform" not in out and "tokens to grpo's final acc." in out

    groups = {g.kind: g for g in rank(_only(load_records([runs["a"], part]), "grpo,trace"))}
    (alloc,) = paired(groups["allocation"], "grpo")
    assert alloc.allocator == "trace" and alloc.seeds == [0, 1, 2] and alloc.tokens_to_baseline is None
    by_seed = {(lr.record.allocator, lr.record.seed): lr.record for r in groups["allocation"].rows for lr in r.records}
    metric = groups["allocation"].rank_metric
    assert alloc.metric_diff == pytest.approx([by_seed["trace", s].final[metric] - by_seed["grpo", s].final[metric] for s in (0, 1, 2)])
    assert alloc.token_ratio == pytest.approx([by_seed["trace", s].spent.tokens / by_seed["grpo", s].spent.tokens for s in (0, 1, 2)])
    assert alloc.ahead == sum(d > 0 for d in alloc.metric_diff) and alloc.level == sum(d == 0 for d in alloc.metric_diff)

    (train,) = paired(groups["training"], "grpo")  # the training track ran only in A: seeds 0 and 1
    assert train.seeds == [0, 1] and len(train.tokens_to_baseline) == 2
    tr = {(lr.record.allocator, lr.record.seed): lr.record for r in groups["training"].rows for lr in r.records}
    for seed, ratio in zip((0, 1), train.tokens_to_baseline):
        target = tr["grpo", seed].evals[-1].accuracy
        assert ratio == pytest.approx(tokens_to_reach(tr["trace", seed].evals, target) / tr["grpo", seed].spent.tokens)


def test_against_a_row_along_the_run_reads_each_evaluation_against_the_baselines_curve(runs, capsys):
    """Two rows can end level where both curves flatten, one having been ahead on the way;
    under the paired table, each training row after each of its evaluations minus the
    baseline's curve at the tokens the row had spent by then, seed by seed."""
    from trace_gym.leaderboard.paired import ALONG_LEGEND, along_baseline, along_table, paired

    # the baseline read linear between its evaluations; beyond its last-evaluated tokens, nothing
    gaps = along_baseline([0, 1000, 3000], [0.2, 0.5, 0.8], [0, 2000], [0.2, 0.6])
    assert gaps[:2] == pytest.approx([0.0, 0.1]) and np.isnan(gaps[2])
    with pytest.raises(ValueError, match="3 spend values for 2 accuracies"):
        along_baseline([0, 1, 2], [0.1, 0.2], [0, 1], [0.1, 0.2])

    (group,) = [g for g in rank(load_records([runs["a"]])) if g.kind == "training"]
    by = {(lr.record.allocator, lr.record.seed): lr.record for row in group.rows for lr in row.records}
    rows = {p.allocator: p for p in paired(group, "grpo")}
    trace = rows["trace"]
    assert trace.seeds == [0, 1] and sorted(trace.along) == [2, 4]  # evaluated after steps 0, 2, 4; step 0 spent nothing
    for i, seed in enumerate(trace.seeds):
        r, b = by["trace", seed], by["grpo", seed]
        for e in r.evals[1:]:
            want = e.accuracy - float(np.interp(e.tokens, [x.tokens for x in b.evals], [x.accuracy for x in b.evals]))
            assert trace.along[e.step][i] == pytest.approx(want) if e.tokens <= b.evals[-1].tokens else np.isnan(trace.along[e.step][i])
        if r.evals[-1].tokens <= b.evals[-1].tokens:  # the thriftier row's last column is the paired table's figure
            assert trace.along[4][i] == pytest.approx(trace.equal_tokens_diff[i])
    head, body = along_table(group, "grpo")
    assert head == ["allocator", "seeds", "after step 2", "after step 4"] and len(body) == len(group.rows) - 1
    assert along_table(group, "grpo", paired(group, "grpo")) == (head, body)  # the rows a caller computed once
    cells = dict((row[0], row[2:]) for row in body)["trace"]
    for cell, step in zip(cells, (2, 4)):
        values = [v for v in trace.along[step] if not np.isnan(v)]
        assert cell.startswith(f"{np.mean(values):+.3f}") and f"({sum(v > 0 for v in values)} of {len(values)})" in cell

    assert run_cli("show", runs["a"], "--against", "grpo") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "against grpo along the run" in out and "after step 2" in out
    assert " ".join(ALONG_LEGEND.format(row="grpo").split()[:12]) in out
    # allocation groups have no evaluations to read along the run
    (alloc,) = [g for g in rank(load_records([runs["a"]])) if g.kind == "allocation"]
    assert along_table(alloc, "grpo")[1] == []


def test_tokens_to_reach_interpolates_between_evaluations():
    from trace_gym.leaderboard.paired import first_reach, t_interval, tokens_to_reach
    from trace_gym.leaderboard.records import EvalPoint

    evals = [EvalPoint(step=s, trajectories=100 * s, tokens=t, accuracy=a, tasks=128)
             for s, t, a in [(0, 0, 0.2), (4, 1000, 0.4), (8, 3000, 0.8)]]
    assert tokens_to_reach(evals, 0.1) == 0.0 and tokens_to_reach(evals, 0.2) == 0.0
    assert tokens_to_reach(evals, 0.3) == pytest.approx(500.0)
    assert tokens_to_reach(evals, 0.6) == pytest.approx(2000.0)
    assert tokens_to_reach(evals, 0.8) == pytest.approx(3000.0) and tokens_to_reach(evals, 0.81) == float("inf")
    assert tokens_to_reach(list(reversed(evals)), 0.6) == pytest.approx(2000.0)  # by step, not by list order
    # a curve first evaluated after some spend reaches a target its first point meets there, not at 0
    assert first_reach([500, 900], [0.5, 0.7], 0.4) == 500.0 and first_reach([500, 900], [0.5, 0.7], 0.6) == pytest.approx(700.0)
    # a seed-averaged curve tying the target up to rounding reaches it
    assert (0.1 + 0.7 + 0.3) / 3 < (0.3 + 0.7 + 0.1) / 3
    assert first_reach([0, 100], [0.1, (0.1 + 0.7 + 0.3) / 3], (0.3 + 0.7 + 0.1) / 3) == 100.0
    with pytest.raises(ValueError, match="2 spend values for 3 accuracies"):
        first_reach([0, 1], [0.1, 0.2, 0.3], 0.2)
    mean, half = t_interval([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / 3 ** 0.5, abs=1e-3)
    assert np.isnan(t_interval([0.5])[1]) and t_interval([1.0, float("inf")])[0] == float("inf")


def test_accuracy_at_equal_tokens_reads_both_curves_where_the_thriftier_run_stopped(runs):
    """Tokens to the baseline's final accuracy divide by the slope where a curve meets it, so
    on a plateau they swing over much of a run; the paired table also gives the accuracy
    difference at equal tokens: both curves read, linear between evaluations, at the fewer of
    the two runs' last-evaluated tokens, with the evaluation's own noise from per-task scores
    mixed by the same weights."""
    from dataclasses import replace

    from trace_gym.leaderboard.paired import EQUAL_TOKENS, accuracy_at, eval_noise, paired, paired_table
    from trace_gym.leaderboard.records import EvalPoint
    from trace_gym.leaderboard.render import render_markdown

    def point(step, tokens, scores):
        return EvalPoint(step=step, trajectories=10 * step, tokens=tokens, accuracy=float(np.mean(scores)), tasks=len(scores),
                         task_scores=scores)

    curve = [point(0, 0, [0.0, 0.5]), point(4, 1000, [0.5, 1.0]), point(8, 3000, [1.0, 1.0])]
    assert accuracy_at(curve, 1000) == (0.75, [0.5, 1.0])  # at an evaluation: its own
    acc, scores = accuracy_at(curve, 2000)  # halfway from step 4 to step 8
    assert acc == pytest.approx(0.875) and scores == pytest.approx([0.75, 1.0])
    assert accuracy_at(list(reversed(curve)), 2000)[0] == pytest.approx(0.875)  # by step, not list order
    assert np.isnan(accuracy_at(curve, 3001)[0]) and accuracy_at(curve, 3001)[1] is None  # past the last evaluation
    assert np.isnan(accuracy_at(curve[1:], 500)[0])  # before the first
    assert accuracy_at([curve[0], curve[1].model_copy(update={"task_scores": None})], 500) == (pytest.approx(0.5), None)
    with pytest.raises(ValueError, match="at least one evaluation"):
        accuracy_at([], 0)

    training = [lr for lr in load_records([runs["a"]]) if lr.record.kind == "training" and lr.record.allocator in ("grpo", "trace")]
    by = {(lr.record.allocator, lr.record.seed): lr.record for lr in training}
    (group,) = rank(training)
    (trace,) = paired(group, "grpo")
    for seed, diff in zip(trace.seeds, trace.equal_tokens_diff):
        r, b = by["trace", seed], by["grpo", seed]
        at = min(r.evals[-1].tokens, b.evals[-1].tokens)
        assert diff == pytest.approx(accuracy_at(r.evals, at)[0] - accuracy_at(b.evals, at)[0])
        assert at in (r.evals[-1].tokens, b.evals[-1].tokens)
    assert trace.equal_tokens_noise is None  # ContrastLab's exact evaluation keeps no per-task scores
    head, (cells,) = paired_table(group, "grpo")
    column = head.index(EQUAL_TOKENS.format(row="grpo"))
    assert head[column + 1].startswith("tokens to grpo's final acc.") and cells[column].startswith(("+", "-"))
    assert "(eval" not in cells[column]
    assert "acc. at equal tokens: the row's held-out accuracy minus grpo's at the fewer" in render_markdown([group], against="grpo")

    # the thriftier row stops halfway between two of the baseline's evaluations: the baseline
    # is read there, per-task scores mixed alike, and the noise is that of the mixed scores
    base = [point(0, 0, [0.0, 0.0, 0.5, 0.5]), point(4, 1000, [0.5, 0.5, 0.5, 1.0]), point(8, 2000, [1.0, 0.5, 1.0, 1.0])]
    mine = [point(0, 0, [0.0, 0.0, 0.5, 0.5]), point(8, 1500, [1.0, 1.0, 0.5, 1.0])]

    def with_evals(lr, evals):
        return replace(lr, record=lr.record.model_copy(update={"evals": evals}))

    seed0 = [with_evals(lr, base if lr.record.allocator == "grpo" else mine) for lr in training if lr.record.seed == 0]
    (only,) = paired(rank(seed0)[0], "grpo")
    halfway = [0.75, 0.5, 0.75, 1.0]
    assert only.equal_tokens_diff == pytest.approx([0.875 - 0.75])
    assert only.equal_tokens_noise == pytest.approx(eval_noise([[1.0, 1.0, 0.5, 1.0]], [halfway]))
    head, (cells,) = paired_table(rank(seed0)[0], "grpo")
    assert cells[head.index(EQUAL_TOKENS.format(row="grpo"))] == f"+0.125 (eval ± {only.equal_tokens_noise:.3f})"


def test_a_baseline_that_ended_no_higher_than_it_started_gives_no_tokens_to_its_final(runs):
    """make run's tiny MathCalc track once printed trace reaching grpo's final with 0.00 x its
    tokens: grpo had ended below the step-0 accuracy both rows started from."""
    from dataclasses import replace

    from trace_gym.leaderboard.paired import paired, paired_table, tokens_to_reach
    from trace_gym.leaderboard.render import render_markdown

    training = [lr for lr in load_records([runs["a"]]) if lr.record.kind == "training" and lr.record.allocator in ("grpo", "trace")]
    by = {(lr.record.allocator, lr.record.seed): lr.record for lr in training}
    start = min(by["grpo", 0].evals[0].accuracy, by["trace", 0].evals[0].accuracy)

    def fell_back(lr):  # grpo ends seed 0 no higher than where both rows started
        r = lr.record
        if (r.allocator, r.seed) != ("grpo", 0):
            return lr
        evals = sorted(r.evals, key=lambda e: e.step)
        return replace(lr, record=r.model_copy(update={"evals": evals[:-1] + [evals[-1].model_copy(update={"accuracy": start})]}))

    (group,) = rank([fell_back(lr) for lr in training])
    assert tokens_to_reach(by["trace", 0].evals, start) == 0.0  # what the table showed before
    (trace,) = paired(group, "grpo")
    assert trace.seeds == [0, 1] and np.isnan(trace.tokens_to_baseline[0])
    target = by["grpo", 1].evals[-1].accuracy
    assert trace.tokens_to_baseline[1] == pytest.approx(tokens_to_reach(by["trace", 1].evals, target) / by["grpo", 1].spent.tokens)
    head, (cells,) = paired_table(group, "grpo")
    cell = cells[head.index("tokens to grpo's final acc. (x grpo's tokens; by seed)")]
    assert cell.startswith("reached on ") and ", 1 n/a (seed 0: n/a; seed 1: " in cell and "0.00" not in cell

    # a row that stops before reaching the target is censored at its own spend: the figure is
    # above its token multiple, which is what decides a target such as "<= 0.6 x"
    def out_of_reach(lr):
        r = lr.record
        if (r.allocator, r.seed) != ("grpo", 1):
            return lr
        return replace(lr, record=r.model_copy(update={"evals": r.evals[:-1] + [r.evals[-1].model_copy(update={"accuracy": 1.0})]}))

    (group,) = rank([out_of_reach(lr) for lr in training])
    (trace,) = paired(group, "grpo")
    assert trace.tokens_to_baseline[1] == float("inf")
    head, (cells,) = paired_table(group, "grpo")
    cell = cells[head.index("tokens to grpo's final acc. (x grpo's tokens; by seed)")]
    # where reached and censored seeds mix, each figure is named by its seed: "0.77 / not by
    # 0.89" read the other way round would be "not by 0.89 / 0.77", two censored seeds to the eye
    assert cell == (f"reached on 1 of 2 seeds (seed 0: {trace.tokens_to_baseline[0]:.2f}; "
                    f"seed 1: not by {trace.token_ratio[1]:.2f})") and "never" not in cell
    assert "not by x: the row did not reach it within its own tokens" in render_markdown([group], against="grpo")


def test_show_keeps_the_seeds_asked_for_and_rows_whose_names_hold_commas(runs, tmp_path, capsys):
    """`show --seeds` keeps the records of those seeds (so rows that ran different seeds can
    still be shown on the ones they share), and `--allocators` splits only at commas outside
    a row's parentheses, so a row labelled trace(m_max=m_min,scope=tree) can be picked."""
    from trace_gym.leaderboard.cli import _only, split_rows

    b_lines = (runs["b"] / "records.jsonl").read_text().splitlines()
    part = tmp_path / "b-part.jsonl"  # seed 2 of grpo and trace only: uniform lacks it
    part.write_text("\n".join(l for l in b_lines if json.loads(l)["allocator"] in ("grpo", "trace")) + "\n")
    assert run_cli("show", runs["a"], part) == 1
    assert "show --seeds or --allocators keeps the records that match" in capsys.readouterr().err
    assert run_cli("show", runs["a"], part, "--seeds", "0,1", "--against", "grpo") == 0
    out = capsys.readouterr().out
    assert "uniform" in out and "0, 1" in out and "0, 1, 2" not in out
    assert run_cli("show", runs["a"], part, "--seeds", "2") == 0
    capsys.readouterr()
    assert run_cli("show", runs["a"], "--seeds", "1,7") == 2
    err = capsys.readouterr().err
    assert "seed(s) 7" in err and "seeds there: 0, 1" in err
    assert run_cli("show", runs["a"], "--seeds", "x") == 2
    assert "whole numbers" in capsys.readouterr().err

    assert split_rows("grpo, trace(m_max=m_min,scope=tree),pcl") == ["grpo", "trace(m_max=m_min,scope=tree)", "pcl"]
    assert split_rows("trace[adv=trace:scale=group],grpo,") == ["trace[adv=trace:scale=group]", "grpo"]
    suite = suite_dict("commas", seeds=(0,), steps=2, trajectories=64,
                       allocators=["grpo", {"name": "trace", "kwargs": {"m_max": "m_min", "scope": "tree"}}])
    suite["tracks"][0]["budget"]["prompts"] = 32
    assert run_cli("run", write_suite(tmp_path / "commas.yaml", suite), "--out", tmp_path / "commas", "--no-progress") == 0
    label = next(r.record.allocator for r in load_records([tmp_path / "commas"]) if r.record.allocator != "grpo")
    assert "," in label
    assert {lr.record.allocator for lr in _only(load_records([tmp_path / "commas"]), label)} == {label}
    assert {lr.record.allocator for lr in _only(load_records([tmp_path / "commas"]), f"grpo,{label}")} == {"grpo", label}
    capsys.readouterr()
    assert run_cli("show", tmp_path / "commas", "--allocators", label) == 0
    assert "trace(m_max=m_min" in capsys.readouterr().out


def test_show_names_the_rows_there_for_a_misspelt_row(runs, capsys):
    assert main(["leaderboard", "show", str(runs["a"]), "--allocators", "grpo,trac"]) == 2
    err = capsys.readouterr().err
    assert "'trac'" in err and "grpo" in err and "uniform" in err
    assert main(["leaderboard", "show", str(runs["a"]), "--against", "grp"]) == 2
    assert "'grp'" in capsys.readouterr().err


def test_run_and_merge_write_the_paired_tables_and_refuse_an_unknown_row_before_running(runs, tmp_path, capsys):
    out = tmp_path / "merged"
    assert run_cli("merge", runs["a"], runs["b"], "--out", out, "--against", "grpo") == 0
    md = (out / "leaderboard.md").read_text()
    assert md.count("### against grpo, paired by seed") == 2 and "| trace | 0, 1, 2 |" in md
    assert "tokens to grpo's final acc." in md and "paired by seed: each row minus" in md
    assert "against grpo, paired by seed" in (out / "leaderboard.html").read_text()
    suite = write_suite(tmp_path / "s.yaml", suite_dict("typo", seeds=(0,), steps=1))
    fresh = tmp_path / "never"
    assert run_cli("run", suite, "--out", fresh, "--against", "grop", "--no-progress") == 2
    err = capsys.readouterr().err
    assert "'grop'" in err and "grpo" in err and not (fresh / "records.jsonl").exists()


def test_merge_of_equal_budget_runs(runs, tmp_path):
    out = tmp_path / "merged"
    # run A twice: the same records read twice are kept once
    assert run_cli("merge", runs["a"], runs["b"], runs["a"] / "records.jsonl", "--out", out) == 0
    merged = load_records([out])
    assert len(merged) == len(ALLOCATORS) * 3 + 6  # allocation: 3 seeds; training: 3 entries x 2 seeds
    group = rank(merged)[0]
    assert all(row.seeds == [0, 1, 2] and row.trajectories == 3 * M * STEPS for row in group.rows)
    assert (out / "leaderboard.html").is_file() and (out / "effective_ratio.png").is_file()
    assert "merged" in (out / "leaderboard.md").read_text()


def test_merge_refuses_unequal_budgets_and_names_the_rows(runs, tmp_path, capsys):
    out = tmp_path / "merged"
    assert run_cli("merge", runs["a"], runs["c"], "--out", out) == 1
    err = capsys.readouterr().err
    assert "refusing to rank" in err and "different trajectories" in err
    grpo_line = next(l for l in err.splitlines() if "grpo:" in l)
    assert "!!" in grpo_line and f"seed 5: {M * (STEPS - 1)}" in grpo_line and "c/records.jsonl:1" in grpo_line
    assert not out.exists()
    with pytest.raises(UnequalBudget):
        rank(load_records([runs["a"], runs["c"]]))
    assert run_cli("show", runs["a"], runs["c"]) == 1


def _edit(path: Path, line_no: int, fn) -> None:
    lines = path.read_text().splitlines()
    lines[line_no - 1] = fn(lines[line_no - 1])
    path.write_text("\n".join(lines) + "\n")


def _json_edit(fn):
    def edit(line: str) -> str:
        d = json.loads(line)
        fn(d)
        return json.dumps(d)
    return edit


def _set(path: str, value):
    def fn(d):
        *head, last = path.split(".")
        for k in head:
            d = d[k]
        d[last] = value
    return fn


CORRUPTIONS = {
    "truncated line": (lambda line: line[: len(line) // 2], "", "not a JSON record"),
    "NaN metric": (lambda line: line.replace('"effective_ratio": ', '"effective_ratio": NaN, "x": ', 1), "", "not a JSON record"),
    "missing field": (_json_edit(lambda d: d.pop("seed")), "seed", "missing"),
    "wrong type": (_json_edit(_set("seed", "zero")), "seed", "integer"),
    "unknown field": (_json_edit(_set("score", 1.0)), "score", "not a field"),
    "wrong schema": (_json_edit(_set("schema", "trace-gym/leaderboard-record/0")), "schema", "expected"),
    "spent more than the steps": (_json_edit(lambda d: d["spent"].update(trajectories=d["spent"]["trajectories"] + 1)),
                                  "spent.trajectories", "sum over steps"),
    "budget lowered": (_json_edit(lambda d: d["budget"].update(trajectories_per_step=M // 2)), "steps[0].trajectories",
                       "exceed"),
    "a step removed": (_json_edit(lambda d: d.update(steps=d["steps"][:-1])), "steps", "budget.steps"),
    "metric edited": (_json_edit(lambda d: d["final"].update(effective_sample_ratio=0.99)), "digest", "changed after"),
    "CPU edited": (_json_edit(lambda d: d["cpu"].update(cpu="another CPU")), "digest", "changed after"),
    "not an object": (lambda line: "[1, 2]", "", "JSON object"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_merge_refuses_corrupted_records_naming_record_and_field(runs, tmp_path, capsys, kind):
    edit, field, words = CORRUPTIONS[kind]
    bad = tmp_path / "bad"
    shutil.copytree(runs["b"], bad)
    _edit(bad / "records.jsonl", 2, edit)
    assert run_cli("merge", runs["a"], bad, "--out", tmp_path / "m") == 1
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap long lines
    assert f"{bad / 'records.jsonl'}:2" in err
    if field:
        assert f"field '{field}'" in err
    assert words in err
    assert not (tmp_path / "m").exists()


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """``src``'s records with ``edit(record_dict)`` applied to each, resealed, in ``dst``."""
    lines = []
    for line in (src / "records.jsonl").read_text().splitlines():
        d = json.loads(line)
        edit(d)
        d["digest"] = compute_digest(d)
        lines.append(json.dumps(d, sort_keys=True, allow_nan=False))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "records.jsonl").write_text("\n".join(lines) + "\n")
    return dst


def test_records_written_before_the_cpu_was_recorded_still_load_and_keep_their_digest(runs, tmp_path):
    _rewrite(runs["b"], tmp_path, lambda d: d.pop("cpu"))  # as written before records carried the CPU
    old = (tmp_path / "records.jsonl").read_text().splitlines()
    loaded = load_records([tmp_path])
    assert [lr.record.cpu for lr in loaded] == [{}] * len(old)
    # written out again (a merge, a move aside), each is the line it was: its digest still holds
    assert [lr.record.to_json() for lr in loaded] == old
    assert run_cli("merge", tmp_path, runs["a"], "--out", tmp_path / "m") == 0
    assert len(load_records([tmp_path / "m"])) == len(old) + len(load_records([runs["a"]]))


def test_the_first_steps_of_a_longer_run_rank_beside_a_shorter_run(runs, tmp_path, capsys):
    """``show --steps N`` reads each run as its first N steps: cut from a 4-step run, every
    row is the 2-step run of the same suite (same generations, spend, evaluations and
    means over steps), so a longer run ranks beside a shorter one at an equal budget; what
    was measured after the whole run (the shared calibration AUCs) reads as missing."""
    from trace_gym.leaderboard.cut import first_steps
    from trace_gym.leaderboard.runner import SHARED_CALIBRATION

    TIMINGS = {"allocator_ms", "rollout_s", "step_s"}
    def untimed(step):  # the same step takes other wall-clock times in another run
        return step.model_copy(update={"metrics": {k: v for k, v in step.metrics.items() if k not in TIMINGS}})

    suite = write_suite(tmp_path / "short.yaml", suite_dict("small-short", seeds=(0,), steps=2, training=True))
    assert run_cli("run", suite, "--out", tmp_path / "short", "--no-progress") == 0
    short = {(r.kind, r.allocator): r for r in (lr.record for lr in load_records([tmp_path / "short"]))}
    longer = [lr.record for lr in load_records([runs["a"]]) if lr.record.seed == 0]
    assert {(r.kind, r.allocator) for r in longer} == set(short) and len(short) == 6
    for rec in longer:
        cut, real = first_steps(rec, 2), short[rec.kind, rec.allocator]
        assert rec.budget.steps == STEPS and cut.budget == real.budget
        assert [s.generated for s in cut.steps] == [s.generated for s in real.steps]
        assert [untimed(s) for s in cut.steps] == [untimed(s) for s in real.steps] and cut.evals == real.evals
        assert (cut.spent.trajectories, cut.spent.tokens) == (real.spent.trajectories, real.spent.tokens)
        assert cut.spent.wall_s <= rec.spent.wall_s
        assert set(cut.final) == set(rec.final)
        for name, value in real.final.items():
            if name in TIMINGS:
                continue
            if name in SHARED_CALIBRATION:
                assert cut.final[name] is None
            elif value is None:
                assert cut.final[name] is None, name
            else:
                assert cut.final[name] == pytest.approx(value, abs=1e-12), name
        if rec.kind == "training":
            assert cut.final["accuracy"] == cut.evals[-1].accuracy != rec.final["accuracy"]
        assert cut.digest == cut.content_digest() and (cut.run, cut.seed, cut.group) == (rec.run, rec.seed, rec.group)
    assert first_steps(longer[0], STEPS) is longer[0]

    # the CLI: the trace rows' 4-step runs beside grpo's 2-step runs, as a longer run of a
    # new allocator beside the baseline's shorter one: refused as they are, ranked at 2 steps
    def only(src: Path, dst: Path, keep) -> Path:
        dst.mkdir()
        lines = (src / "records.jsonl").read_text().splitlines()
        (dst / "records.jsonl").write_text("".join(l + "\n" for l in lines if keep(json.loads(l))))
        return dst
    grpo_short = only(tmp_path / "short", tmp_path / "grpo-short", lambda d: d["allocator"] == "grpo")
    long_rest = only(runs["a"], tmp_path / "long-rest", lambda d: d["allocator"] != "grpo" and d["seed"] == 0)
    capsys.readouterr()
    assert run_cli("show", grpo_short, long_rest) == 1
    assert "different trajectories" in capsys.readouterr().err
    assert run_cli("show", grpo_short, long_rest, "--steps", 2, "--against", "grpo") == 0
    out = capsys.readouterr().out
    assert "x 2 steps" in out and "x 4 steps" not in out and "paired by seed" in out
    assert "every row spent the same trajectories" in out and "held-out acc. − grpo's at equal tokens" in out
    note = " ".join(out.split())
    assert "--steps 2: 4 of 6 record(s) read as their runs' first 2 steps; measured after the whole run, their auc_prefix" in note
    # what cannot be cut is a usage error naming each record and why
    assert run_cli("show", grpo_short, runs["b"], "--steps", 3) == 2
    err = capsys.readouterr().err
    assert "ran 2 steps, fewer than the 3 asked for" in err and "grpo-short/records.jsonl:" in err and "b/records.jsonl" not in err
    assert run_cli("show", runs["a"], "--steps", 3) == 2
    err = capsys.readouterr().err
    assert "was not evaluated after step 3 (evaluated after steps 0, 2, 4)" in err and "records.jsonl:" in err
    assert run_cli("show", runs["a"], "--steps", 0) == 2
    assert "at least one" in capsys.readouterr().err
    # a trainer whose learning rate decays over the run (a cosine schedule) took its first
    # steps at other rates than a shorter run: refused; a warm-up that rises is not a decay
    from trace_gym.leaderboard.cut import CutError, decayed_rate
    from trace_gym.leaderboard.records import make_record

    def with_rates(rec, rates):
        fields = rec.model_dump(by_alias=False, exclude={"schema_", "digest"})
        for step, rate in zip(fields["steps"], rates):
            step["metrics"]["lr"] = rate
        return make_record(**fields)
    trained = next(r for r in longer if r.kind == "training")
    warm = with_rates(trained, [2e-4, 4e-4, 4e-4, 4e-4])
    assert decayed_rate(warm) is None and first_steps(warm, 2).evals == short["training", trained.allocator].evals
    cosine = with_rates(trained, [4e-4, 3.4e-4, 2e-4, 0.6e-4])
    assert decayed_rate(cosine) == (4e-4, 0.6e-4)
    with pytest.raises(CutError, match="learning rate fell from 0.0004 to 6e-05 over its 4 steps"):
        first_steps(cosine, 2)
    assert first_steps(cosine, STEPS) is cosine  # uncut, it is its own run

    # merge writes the cut records, which load as records of the shorter run
    assert run_cli("merge", grpo_short, long_rest, "--steps", 2, "--against", "grpo", "--out", tmp_path / "merged") == 0
    assert "read as their runs' first 2 steps" in " ".join(capsys.readouterr().out.split())
    merged = {(r.kind, r.allocator): r for r in (lr.record for lr in load_records([tmp_path / "merged"]))}
    assert {k: (r.budget, r.evals, r.spent.tokens) for k, r in merged.items()} == \
        {k: (r.budget, r.evals, r.spent.tokens) for k, r in short.items()}
    assert "read as their runs' first 2 steps" in (tmp_path / "merged" / "leaderboard.md").read_text()
    assert run_cli("merge", runs["a"], "--steps", 3, "--out", tmp_path / "not-written") == 2
    assert not (tmp_path / "not-written").exists()


def test_compare_finds_the_step_where_two_runs_of_a_row_part(runs, tmp_path, capsys):
    """Every step records a fingerprint of its generations; the same suite run again, its rows
    in the opposite order, generated the same at every step (a row does not depend on the rows
    before it), and ``compare`` names the first step where a row's runs part."""
    records = [lr.record for lr in load_records([runs["b"]])]
    for r in records:
        assert all(re.fullmatch("[0-9a-f]{16}", s.generated) for s in r.steps)
        assert len({s.generated for s in r.steps}) == STEPS  # each step drew other prompts
    suite = write_suite(tmp_path / "b.yaml", suite_dict("small-b-again", seeds=(2,), allocators=ALLOCATORS[::-1]))
    assert run_cli("run", suite, "--out", tmp_path / "again", "--no-progress") == 0
    capsys.readouterr()
    assert run_cli("compare", runs["b"], tmp_path / "again") == 0
    out = capsys.readouterr().out
    assert out.count(f"same at all {STEPS} steps") == len(ALLOCATORS)
    assert f"{len(ALLOCATORS)} of {len(ALLOCATORS)} row(s) both runs hold generated the same" in out

    def part_trace_at_step_2(d):
        if d["allocator"] == "trace":
            d["steps"][2]["generated"] = "0" * 16
    assert run_cli("compare", runs["b"], _rewrite(tmp_path / "again", tmp_path / "parted", part_trace_at_step_2)) == 3
    out = capsys.readouterr().out
    assert "parts at step 2 of 4; steps 0-1 the same" in out and out.count("same at all") == len(ALLOCATORS) - 1

    # records written before steps carried fingerprints: told apart by token counts only
    def unfingerprinted(d):
        for s in d["steps"]:
            del s["generated"]
        if d["allocator"] == "grpo":
            d["steps"][1]["tokens"] += 1
            d["spent"]["tokens"] += 1
    old = _rewrite(runs["b"], tmp_path / "old", unfingerprinted)
    assert [lr.record.to_json() for lr in load_records([old])] == (old / "records.jsonl").read_text().splitlines()
    assert run_cli("compare", old, tmp_path / "again") == 3
    out = capsys.readouterr().out
    assert "parts at step 1 of 4 (token counts differ)" in out and "steps 0-0" not in out
    assert out.count("unknown: no fingerprints (older records); token counts equal at all 4 steps") == len(ALLOCATORS) - 1

    # runs that share no row: a usage error, not an empty table
    assert run_cli("compare", runs["a"], runs["b"]) == 2
    assert "no row" in capsys.readouterr().err


def test_a_run_with_kernels_held_to_another_isa_says_so(tmp_path, monkeypatch):
    # MKL_CBWR (or an ATen / oneDNN ISA cap) makes this CPU round as another would; torch's own
    # capability does not show MKL's, so the record must carry the variable itself
    for name in KERNEL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert "kernel_env" not in cpu_info()
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    suite = write_suite(tmp_path / "held.yaml", suite_dict("held", seeds=(0,), steps=1, allocators=["grpo"]))
    assert run_cli("run", suite, "--out", tmp_path / "held", "--no-progress") == 0
    (record,) = [lr.record for lr in load_records([tmp_path / "held"])]
    assert record.cpu["kernel_env"] == "MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
    assert f"CPU(s) {record.cpu['cpu']} [MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2]" in (tmp_path / "held" / "leaderboard.html").read_text()


def test_duplicate_seed_from_another_run_is_refused(runs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(runs["a"], other)
    _edit(other / "records.jsonl", 1, _json_edit(lambda d: (d.update(run="elsewhere"), d.update(digest=compute_digest(d)))))
    with pytest.raises(RecordError, match=r"records.jsonl:1: field 'seed': a different record .* already at"):
        load_records([runs["a"], other])


def test_missing_run_folder(tmp_path, capsys):
    assert run_cli("show", tmp_path / "nope") == 1
    assert "no such run folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------- suites


BAD_SUITES = {
    "misspelt key": (lambda d: d["tracks"][0].__setitem__("alocators", d["tracks"][0].pop("allocators")),
                     "tracks[0].alocators: unknown key 'alocators'; did you mean 'allocators'?"),
    "unknown allocator": (lambda d: d["tracks"][0].__setitem__("allocators", ["grpo", "trac"]),
                          "tracks[0].allocators[1].name: unknown allocator 'trac'; did you mean 'trace'"),
    "unknown env": (lambda d: d["tracks"][0].__setitem__("envs", ["trace_gym/ContrastLab-v1"]),
                    "tracks[0].envs[0].id: unknown environment 'trace_gym/ContrastLab-v1'; did you mean 'trace_gym/ContrastLab-v0'"),
    "unknown kind": (lambda d: d["tracks"][0].__setitem__("kind", "alocation"), "did you mean 'allocation'"),
    "unknown predictor": (lambda d: d["tracks"][0].__setitem__("predictor", "hashd"),
                          "tracks[0].predictor: unknown predictor 'hashd'; did you mean 'hashed'"),
    "bad budget": (lambda d: d["tracks"][0]["budget"].__setitem__("trajectories", 0), "tracks[0].budget.trajectories:"),
    "missing budget": (lambda d: d["tracks"][0].pop("budget"), "tracks[0].budget: required key is missing"),
    "nested typo": (lambda d: d["tracks"][0]["budget"].__setitem__("prompt", 3),
                    "tracks[0].budget.prompt: unknown key 'prompt'; did you mean 'prompts'"),
    "training without eval": (lambda d: d["tracks"][0].__setitem__("kind", "training"), "needs an `eval` section"),
    "duplicate allocator": (lambda d: d["tracks"][0].__setitem__("allocators", ["grpo", "grpo"]), "appear more than once"),
    "bad estimator option": (lambda d: d["tracks"][0].__setitem__("allocators", ["grpo", {"name": "trace", "advantage": "trace:sale=group"}]),
                             "tracks[0].allocators[1].advantage: advantage estimator 'trace': unknown option 'sale' (options: scale, eps)"),
    "unknown allocator predictor": (lambda d: d["tracks"][0].__setitem__("allocators", ["grpo", {"name": "trace", "predictor": "hashd"}]),
                                    "tracks[0].allocators[1].predictor: unknown predictor 'hashd'; did you mean 'hashed'"),
    "unknown track advantage": (lambda d: d["tracks"][0].__setitem__("advantage", "grp"),
                                "tracks[0].advantage: unknown advantage estimator 'grp'; did you mean 'grpo'"),
}


@pytest.mark.parametrize("kind", list(BAD_SUITES))
def test_bad_suite_names_the_key_with_a_hint(tmp_path, capsys, kind):
    edit, expected = BAD_SUITES[kind]
    data = suite_dict()
    edit(data)
    path = write_suite(tmp_path / "bad.yaml", data)
    with pytest.raises(SuiteError) as exc:
        load_suite(str(path))
    assert str(path) in str(exc.value) and expected in str(exc.value)
    assert run_cli("run", path, "--out", tmp_path / "r", "--no-progress") == 2
    assert expected in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "r").exists()


def test_bad_trainer_override_is_refused_before_running(tmp_path, capsys):
    data = suite_dict(training=True)
    data["tracks"][1]["trainer"]["overrides"] = {"model.sim_shared_rl": 1.0}
    path = write_suite(tmp_path / "bad.yaml", data)
    assert run_cli("run", path, "--out", tmp_path / "r", "--no-progress") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "track 'learning', trainer:" in err and "model.sim_shared_rl" in err and "did you mean 'model.sim_shared_lr'" in err
    assert not (tmp_path / "r").exists()


def test_unknown_preset_suggests_the_close_one(capsys):
    assert run_cli("run", "quik", "--no-progress") == 2
    assert "did you mean 'quick'" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["quick", "standard", "paper"])
def test_presets_validate(preset):
    from trace_gym.leaderboard.runner import preflight

    spec = load_suite(preset)
    preflight(spec)  # the trainer and warm-start configs they name exist and accept their overrides
    kinds = {t.kind for t in spec.tracks}
    assert kinds == {"allocation", "training"}
    envs = {e.id for t in spec.tracks for e in t.envs}
    assert {"trace_gym/MathCalc-v0", "trace_gym/ToolCalls-v0"} <= envs or preset == "paper"
    for t in spec.tracks:
        assert {"grpo", "trace"} <= {a.name for a in t.allocators}


def test_every_preset_file_validates():
    from trace_gym.leaderboard.runner import preflight
    from trace_gym.leaderboard.spec import preset_names

    assert {"quick", "standard", "paper", "smollm2-math"} <= set(preset_names())
    for name in preset_names():
        preflight(load_suite(name))


def test_suite_yaml_round_trip():
    spec = parse_suite(suite_dict())
    assert parse_suite(spec.model_dump(mode="json")) == spec


# ----------------------------------------------------------------------------- a person's view


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_headless_screenshot_shows_table_and_plot(runs, tmp_path):
    from PIL import Image

    shot = tmp_path / "leaderboard.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,1600",
           "--hide-scrollbars", (runs["a"] / "leaderboard.html").resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape[:2] == (1600, 1280)
    # the winner's row is tinted green (#eaf6ea), the table has grey header cells (#eef1f6),
    # and the embedded plot draws matplotlib's default blue line (#1f77b4)
    def has(rgb, tol=6):
        return bool((np.abs(img - np.array(rgb)).max(axis=2) <= tol).sum() > 200)
    assert has((0xEA, 0xF6, 0xEA)), "the ranked table's first row is not visible"
    assert has((0xEE, 0xF1, 0xF6)), "the table header is not visible"
    assert has((0x1F, 0x77, 0xB4), tol=30), "the effective-ratio plot is not visible"
    if os.environ.get("TRACE_GYM_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["TRACE_GYM_KEEP_SCREENSHOT"])


# ----------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_model_tracks_run_through_the_rollout_engine_and_the_trainer(tmp_path):
    """The tiny from-scratch preset (untrained: this checks the plumbing, not the numbers)
    through the rollout engine (allocation track) and RLTrainer (training track)."""
    policy = {"name": "hf", "model": "tiny", "max_new_tokens": 8}
    env = {"id": "trace_gym/MathCalc-v0", "kwargs": {"max_turns": 2}}
    budget = {"trajectories": 8, "prompts": 4, "group_size": 2}
    suite = write_suite(tmp_path / "tiny.yaml", {"suite": "tiny", "seeds": [0], "tracks": [
        {"name": "alloc", "kind": "allocation", "envs": [env], "policy": policy, "allocators": ["grpo", "trace"],
         "budget": budget, "steps": 2},
        {"name": "train", "kind": "training", "envs": [env], "policy": policy, "allocators": ["grpo", "trace"],
         "budget": budget, "steps": 1, "eval": {"tasks": 4, "k": 1, "every": 1},
         "trainer": {"overrides": {"model.threads": 1, "optim.micro_batch_tokens": 4096}}},
    ]})
    assert run_cli("run", suite, "--out", tmp_path / "out", "--no-progress") == 0
    records = [lr.record for lr in load_records([tmp_path / "out"])]
    assert sorted((r.track, r.allocator) for r in records) == [("alloc", "grpo"), ("alloc", "trace"), ("train", "grpo"),
                                                               ("train", "trace")]
    for r in records:
        assert [s.trajectories for s in r.steps] == [8] * r.budget.steps
        assert all(s.tokens > 0 for s in r.steps)
        # each step's generations fingerprinted, through the rollout engine and through RLTrainer
        assert all(re.fullmatch("[0-9a-f]{16}", s.generated) for s in r.steps)
        if r.kind == "training":
            assert [(e.step, e.trajectories, e.tasks) for e in r.evals] == [(0, 0, 4), (1, 8, 4)]
            assert 0.0 <= r.final["accuracy"] <= 1.0
    assert (tmp_path / "out" / "accuracy_vs_budget.png").is_file()


def test_rollout_failures_are_reported_not_hidden(tmp_path, monkeypatch, capsys):
    """A row whose generations fail (here every other call of the policy raises, as a GPU that
    runs out of memory would) says so: a warning with the error on the console, its share in
    the record's ``failed_share`` and a 'failed' column in the table. Rows without failures
    leave the column out."""
    from trace_gym.policies.hf import HFPolicy

    real, calls = HFPolicy.generate, [0]

    def flaky(self, prompts, params):
        calls[0] += 1
        if calls[0] % 2 == 0:
            raise RuntimeError("CUDA out of memory (planted by the test)")
        return real(self, prompts, params)

    policy = {"name": "hf", "model": "tiny", "max_new_tokens": 8}
    env = {"id": "trace_gym/MathCalc-v0", "kwargs": {"max_turns": 2}}
    suite = write_suite(tmp_path / "flaky.yaml", {"suite": "flaky", "seeds": [0], "tracks": [
        {"name": "alloc", "kind": "allocation", "envs": [env], "policy": policy, "allocators": ["grpo"],
         "budget": {"trajectories": 8, "prompts": 4, "group_size": 2}, "steps": 2}]})
    assert run_cli("run", suite, "--out", tmp_path / "clean", "--no-progress") == 0
    assert "failed" not in (tmp_path / "clean" / "leaderboard.md").read_text().split("\n| rank")[1].split("\n")[0]
    monkeypatch.setattr(HFPolicy, "generate", flaky)
    capsys.readouterr()
    assert run_cli("run", suite, "--out", tmp_path / "flaky", "--no-progress") == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "trajectories failed" in err and "planted by the test" in err
    (record,) = [lr.record for lr in load_records([tmp_path / "flaky"])]
    failed = sum(s.metrics["failed_trajectories"] for s in record.steps)
    assert failed > 0 and record.final["failed_share"] == pytest.approx(failed / 16)
    header = (tmp_path / "flaky" / "leaderboard.md").read_text().split("\n| rank")[1].split("\n")[0]
    assert "failed ↓" in header
