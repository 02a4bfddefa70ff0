"""The whole TRACE ablation grid on ContrastLab, as one command, with 95% intervals over seeds.

    python benchmarks/ablation_grid.py                       # both parts, 3 seeds, every predictor (~2 h on 2 cores)
    python benchmarks/ablation_grid.py --predictors beta,hashed,hashed:counts=true   # without lm (~35 min)
    python benchmarks/ablation_grid.py --part allocation     # the frozen-policy part only
    python benchmarks/ablation_grid.py --part learning --jobs 2 --json grid.json --markdown grid.md

Axes (every combination; a stage that uses no predictor collapses the predictor axis):

* stage 1: ``uniform`` | ``paper`` (V_root at the point estimate) | ``posterior`` (expected
  mixing under the predictor's Beta predictive);
* stage 2: ``none`` (stage 1 spends the whole budget) | ``uniform`` | ``prefix`` (active over
  every pure prefix, the paper's objective, ``scope=subtree``) | ``tree`` (active over
  prefixes of trees not yet mixed, ``scope=tree``) | ``mixed`` (active over the pure
  prefixes of trees already mixed, ``scope=mixed``);
* predictor: ``beta`` | ``hashed`` (the shared model) | ``hashed:counts=true`` (with
  per-prompt counts) | ``lm:segments=turns`` (a frozen MiniLM encoder that reads the prompt
  and each turn once; a worker's first run of a seed encodes that seed's prompts, a few
  minutes on a CPU, and its later runs reuse the embeddings, under a minute each). ``lm`` in
  its default form (``segments=history``) reads every prefix whole, minutes per step at
  M = 1024 on a CPU: pass ``--predictors ...,lm`` where a GPU is at hand;
* advantage: ``grpo`` | ``trace`` | ``treerl`` | ``tree_grpo`` | ``trace:scale=group``.

Beside the grid run the baselines and competitors (``grpo``, ``uniform``, ``dapo``, ``pcl``,
``knapsack``, ``greso``, ``vip``, ``trace-paper``, ``oracle``, ``oracle-er``) with their own
predictor and advantage.

**Allocation part** (frozen policy; the bench's reference workload: 512 candidates, M = 1024,
``--steps`` steps): one run per (stage 1, stage 2, predictor, seed); the advantage does not
change the allocation, so each run reports its effective sample ratio under every
estimator (``trace:scale=group`` has the non-zero pattern of ``trace``). Columns: effective
ratio, effective sample ratio (trajectories) under each estimator, generated tokens per
step, prompts sampled.

**Learning part** (ContrastLab's learning mode: a REINFORCE step of the simulated policy on
each step's advantages, by default scale-free and charged for waste (advantages scaled to
unit RMS over the turns where they are non-zero, the shared skill moved by the mean over
every generated turn: :class:`~trace_gym.sim.learning.SimLearning`); ``--sgd``: plain SGD,
where an estimator's step grows with the size of its advantages; ``--lr``/``--shared-lr`` as
in ``configs/contrastlab.yaml``):
one run per (grid cell, advantage, seed) and per baseline. Held-out accuracy (exact mean
success of the 512 test tasks) after every step; ``tokens_to_grpo`` is the generated tokens
a run needs to first reach the final held-out accuracy of ``grpo`` on the same seed (linear
interpolation between steps), divided by the tokens ``grpo`` spent; likewise
``trajectories_to_grpo``. A run that never reaches it scores ``inf`` for that seed; on a
seed where grpo ended no higher than it started every run scores NaN (n/a: no gain to
reach), and the tables leave that seed out of the interval and count it. Beside it, the
held-out accuracy at equal tokens: the run's minus grpo's on the same seed at the fewer of
the two runs' tokens (linear between steps, as the leaderboard's paired tables read it),
which does not divide by the slope of a curve that has flattened.

Intervals: mean +- t(0.975, n-1) * sd / sqrt(n) over seeds (n = 3: t = 4.30), so with three
seeds an interval is wide; a mean with an ``inf`` seed is ``inf``. Rows are ranked by the
named figure of each table. Nothing here is tuned; the figures are what the runs give.

``--against ROW`` adds paired comparisons: every row minus ``ROW`` seed by seed (the same
seed draws the same pool and world for every row, so the pairing removes what the seeds
share), the mean difference with its 95% interval and the number of seeds on which the row
is ahead; on the effective sample ratio under grpo's advantage (allocation part) and on the
tokens to grpo's final held-out accuracy (learning part; seeds where either run never gets
there are left out and counted).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from seed_stats import fmt, interval, paired_table  # this script's own folder: run as a script, it is on sys.path
from trace_gym.leaderboard.paired import difference_at_equal_spend, ratio_to_baseline_final
from trace_gym.sim.difficulty import DEFAULT_DIFFICULTY

STAGE1 = ("uniform", "paper", "posterior")
STAGE2 = ("none", "uniform", "prefix", "tree", "mixed")
SCOPES = {"prefix": "subtree", "tree": "tree", "mixed": "mixed"}  # active stage 2: trace's scope
PREDICTORS = ("beta", "hashed", "hashed:counts=true", "lm:segments=turns")
ADVANTAGES = ("grpo", "trace", "treerl", "tree_grpo", "trace:scale=group")
ALLOCATION_ADVANTAGES = ("grpo", "trace", "treerl", "tree_grpo")  # trace:scale=group counts as trace
BASELINES = ("grpo", "uniform", "dapo", "pcl", "knapsack", "greso", "vip", "trace-paper", "oracle", "oracle-er")


def grid_cells(predictors: tuple[str, ...], m_min: int | str = "budget") -> list[dict[str, Any]]:
    """Every (stage 1, stage 2, predictor) cell of the grid, as an allocator spec and a label;
    ``m_min``: every cell's stage-1 group minimum (``trace``'s option; "budget": the paper's 2)."""
    cells = []
    for s1, s2 in itertools.product(STAGE1, STAGE2):
        uses_predictor = s1 != "uniform" or s2 in SCOPES
        for pred in (predictors if uses_predictor else (None,)):
            kwargs: dict[str, Any] = {"stage1": s1, "stage2": "active" if s2 in SCOPES else s2, "m_min": m_min}
            if s2 in SCOPES:
                kwargs["scope"] = SCOPES[s2]
            if pred is not None:
                kwargs["predictor"] = pred
            cells.append({"label": f"trace s1={s1} s2={s2}" + (f" pred={pred}" if pred else ""),
                          "stage1": s1, "stage2": s2, "predictor": pred, "spec": {"name": "trace", "kwargs": kwargs}})
    return cells


def baseline_spec(text: str) -> dict[str, Any]:
    """``"pcl"``, ``"pcl:seed=1"`` or ``"pcl[pred=hashed:counts=true]"`` (another predictor,
    whose options may hold colons) as an allocator spec."""
    from trace_gym.run import ComponentSpec

    name, _, pred = text.partition("[pred=")
    spec = ComponentSpec.model_validate(name).model_dump()
    if pred:
        spec["kwargs"]["predictor"] = pred.rstrip("]")
    return spec


def _config(args: argparse.Namespace, seed: int, learn: float):
    from trace_gym.sim.bench import BenchConfig

    return BenchConfig(allocators=["grpo"], steps=args.steps, prompts=args.prompts, trajectories=args.trajectories,
                       tasks=args.tasks, seed=seed, learn=learn, difficulty=args.difficulty,
                       shared_lr=args.shared_lr if learn > 0 else 0.1,
                       normalize=not args.sgd, prefix_weight=args.prefix_weight if learn > 0 else 0.0,
                       eval_prompts=args.eval_prompts)


_WORLDS: dict[int, Any] = {}
_EVALS: dict[int, Any] = {}


def _job(task: dict[str, Any]) -> dict[str, Any]:
    """One run (in a worker process): an allocator spec on one seed, frozen or learning."""
    from trace_gym.sim.bench import run_allocator
    from trace_gym.sim.evaluation import evaluation_set
    from trace_gym.sim.world import ContrastLabWorld

    args = argparse.Namespace(**task["args"])
    seed, learn = task["seed"], task["learn"]
    config = _config(args, seed, learn)
    if seed not in _WORLDS:
        _WORLDS[seed] = ContrastLabWorld(seed=seed, **config.world_kwargs())
        _EVALS[seed] = evaluation_set(_WORLDS[seed], config.eval_prompts, config.eval_rollouts)
    spec = dict(task["spec"])
    if task.get("advantage"):
        spec["kwargs"] = {**spec.get("kwargs", {}), "advantage": task["advantage"]}
    t0 = time.perf_counter()
    out = run_allocator(spec, _WORLDS[seed], config, eval_set=_EVALS[seed] if learn == 0 else None)
    out.pop("steps", None)
    out["wall_s"] = time.perf_counter() - t0
    return {"key": task["key"], "seed": seed, "result": out}


def ratio_to_grpo(curve: list[dict[str, Any]], grpo_curve: list[dict[str, Any]], key: str) -> float:
    """``key`` spent when ``curve`` first reaches the final held-out accuracy of ``grpo_curve``
    (linear between steps), over grpo's (the package's
    :func:`~trace_gym.leaderboard.paired.ratio_to_baseline_final`: inf never, NaN where grpo
    ended no higher than it started)."""
    def acc(c: list[dict[str, Any]]) -> list[float]:
        return [p["test_success"] for p in c]

    return ratio_to_baseline_final([p[key] for p in curve], acc(curve), acc(grpo_curve), grpo_curve[-1][key])


def accuracy_over_grpo_at_equal_tokens(curve: list[dict[str, Any]], grpo_curve: list[dict[str, Any]]) -> float:
    """Held-out accuracy of ``curve`` minus ``grpo_curve``'s at the fewer of the two runs'
    tokens, both linear between steps (the package's
    :func:`~trace_gym.leaderboard.paired.difference_at_equal_spend`, as the leaderboard's paired
    tables read it)."""
    return difference_at_equal_spend([p["tokens"] for p in curve], [p["test_success"] for p in curve],
                                     [p["tokens"] for p in grpo_curve], [p["test_success"] for p in grpo_curve])


def run_part(args: argparse.Namespace, learn: float, rows: list[dict[str, Any]], advantages: tuple[str | None, ...]) -> dict:
    """Run ``rows`` x ``advantages`` x seeds; returns ``{key: {seed: result}}``."""
    seeds = [int(s) for s in args.seeds.split(",")]
    tasks = []
    for row in rows:
        for adv in (advantages if row.get("grid") else (None,)):
            key = row["label"] + (f" adv={adv}" if adv else "")
            for seed in seeds:
                tasks.append({"key": key, "spec": row["spec"], "advantage": adv, "seed": seed, "learn": learn,
                              "args": vars(args)})
    out: dict[str, dict[int, Any]] = {}
    t0 = time.perf_counter()
    done = 0
    # One line per finished run, in completion order: an lm run takes ~15 min, so waiting for
    # submission order (or every tenth run) left long silences.
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for fut in as_completed([pool.submit(_job, t) for t in tasks]):
            res = fut.result()
            out.setdefault(res["key"], {})[res["seed"]] = res["result"]
            done += 1
            print(f"  {done}/{len(tasks)} runs, {time.perf_counter() - t0:.0f} s: {res['key']} seed {res['seed']}",
                  file=sys.stderr, flush=True)
    order = list(dict.fromkeys(t["key"] for t in tasks))
    return {key: dict(sorted(out[key].items())) for key in order}


def allocation_table(runs: dict[str, dict[int, Any]]) -> list[str]:
    """Markdown rows of the allocation part, ranked by the effective sample ratio under grpo's advantage."""
    head = ["rank", "row", "eff. ratio %"] + [f"ESR ({a} adv.) %" for a in ALLOCATION_ADVANTAGES] + \
        ["tokens/step", "prompts", "AUC prefixes"]
    rows = []
    for key, by_seed in runs.items():
        rs = list(by_seed.values())
        esr = {a: interval([r["effective_sample_ratio_by_advantage"][a]["trajectories"] for r in rs]) for a in ALLOCATION_ADVANTAGES}
        aucs = [((r.get("calibration") or {}).get("prefixes") or {}).get("auc") for r in rs]
        rows.append((esr["grpo"][0], [key, fmt(interval([r["effective_ratio"] for r in rs]), True)]
                     + [fmt(esr[a], True) for a in ALLOCATION_ADVANTAGES]
                     + [f"{statistics.fmean(r['tokens'] for r in rs):,.0f}", f"{statistics.fmean(r['prompts'] for r in rs):.0f}",
                        "-" if None in aucs else f"{statistics.fmean(aucs):.3f}"]))
    rows.sort(key=lambda x: -x[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += [f"| {i + 1} | " + " | ".join(r) + " |" for i, (_, r) in enumerate(rows)]
    return lines


def learning_summary(runs: dict[str, dict[int, Any]]) -> dict[str, dict[str, Any]]:
    """Per run key: final held-out accuracy, tokens/trajectories to reach grpo's final
    accuracy (per seed; inf: never reached; NaN on a seed where grpo's curve ended no higher
    than it started, which a row from the same start would "reach" at 0) and held-out accuracy
    minus grpo's at equal tokens (:func:`accuracy_over_grpo_at_equal_tokens`)."""
    grpo = runs["grpo"]
    out = {}
    for key, by_seed in runs.items():
        tok, traj, acc, equal = [], [], [], []
        for seed, r in sorted(by_seed.items()):
            tok.append(ratio_to_grpo(r["curve"], grpo[seed]["curve"], "tokens"))
            traj.append(ratio_to_grpo(r["curve"], grpo[seed]["curve"], "trajectories"))
            acc.append(r["final_test_success"])
            equal.append(accuracy_over_grpo_at_equal_tokens(r["curve"], grpo[seed]["curve"]))
        out[key] = {"tokens_to_grpo": tok, "trajectories_to_grpo": traj, "final_test_success": acc, "equal_tokens_diff": equal,
                    "initial_test_success": statistics.fmean(r["curve"][0]["test_success"] for r in by_seed.values())}
    return out


def _over_gaining_seeds(values: list[float]) -> tuple[float, float] | None:
    """:func:`interval` over the seeds where grpo gained (NaN left out); None where it gained on none."""
    kept = [x for x in values if not math.isnan(x)]
    return interval(kept) if kept else None


def _ratio_text(values: list[float]) -> str:
    mi = _over_gaining_seeds(values)
    return "n/a" if mi is None else fmt(mi)


def _ratio_sort(values: list[float]) -> float:
    """A row's place by its mean ratio: never reached after every reached one, n/a last."""
    mi = _over_gaining_seeds(values)
    return 2e9 if mi is None else 1e9 if math.isinf(mi[0]) else mi[0]


def _signed(values: list[float] | None) -> str:
    """Mean ± 95% interval with its sign, 3 decimals ("-" in a summary saved before the figure existed)."""
    if not values:
        return "-"
    m, h = interval(values)
    return f"{m:+.3f}" + ("" if math.isnan(h) else f" ± {h:.3f}")


def learning_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows of the learning part, ranked by tokens to reach grpo's final held-out
    accuracy (over the seeds where grpo gained; "seeds reaching it" counts the others as n/a)."""
    head = ["rank", "row", "tokens to grpo's final acc. (x grpo's)", "trajectories to it (x grpo's)", "final held-out acc.",
            "held-out acc. − grpo's at equal tokens", "seeds reaching it"]
    rows = []
    for key, s in summary.items():
        vals = s["tokens_to_grpo"]
        reached = sum(math.isfinite(x) for x in vals)
        na = sum(math.isnan(x) for x in vals)
        seeds = f"{reached}/{len(vals) - na}" + (f", {na} n/a (grpo did not gain)" if na else "")
        sort_key = (_ratio_sort(vals), -statistics.fmean(s["final_test_success"]))
        rows.append((sort_key, [key, _ratio_text(vals), _ratio_text(s["trajectories_to_grpo"]),
                                fmt(interval(s["final_test_success"]), digits=3), _signed(s.get("equal_tokens_diff")), seeds]))
    rows.sort(key=lambda x: x[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += [f"| {i + 1} | " + " | ".join(r) + " |" for i, (_, r) in enumerate(rows)]
    return lines


def allocation_paired(runs: dict[str, dict[int, Any]], against: str) -> list[str]:
    """:func:`paired_table` on the effective sample ratio under grpo's advantage, in points."""
    esr = {k: {s: r["effective_sample_ratio_by_advantage"]["grpo"]["trajectories"] for s, r in v.items()} for k, v in runs.items()}
    return paired_table(esr, against, "ESR (grpo adv.), points", scale=100.0)


def learning_paired(summary: dict[str, dict[str, Any]], seeds: list[int], against: str) -> list[str]:
    """:func:`paired_table` on the tokens to grpo's final held-out accuracy (x grpo's; lower is better)."""
    tok = {k: dict(zip(seeds, s["tokens_to_grpo"])) for k, s in summary.items()}
    return paired_table(tok, against, "tokens to grpo's final acc. (x grpo's)", higher_is_better=False)


def learning_pivot(summary: dict[str, dict[str, Any]], advantages: tuple[str, ...]) -> list[str]:
    """Markdown: one row per grid cell (and baseline), one column per advantage estimator,
    each entry the tokens needed to reach grpo's final held-out accuracy (x grpo's, mean ±
    95% interval over the seeds where grpo gained; ``–``: some seed never got there, with the
    final accuracy instead; ``n/a``: grpo gained on no seed)."""
    cells: dict[str, dict[str, str]] = {}
    best: dict[str, float] = {}
    for key, s in summary.items():
        cell, _, adv = key.partition(" adv=")
        vals, acc = s["tokens_to_grpo"], statistics.fmean(s["final_test_success"])
        mi = _over_gaining_seeds(vals)
        reached = mi is not None and not math.isinf(mi[0])
        cells.setdefault(cell, {})[adv or "own"] = fmt(mi) if reached else "n/a" if mi is None else f"– (acc. {acc:.3f})"
        # among rows that did not reach grpo's final, the higher final accuracy first
        best[cell] = min(best.get(cell, math.inf), _ratio_sort(vals) - (0.0 if reached else acc))
    head = ["row"] + [f"adv. {a}" for a in advantages] + ["own adv."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for cell in sorted(cells, key=lambda c: best[c]):
        lines.append("| " + " | ".join([cell] + [cells[cell].get(a, "") for a in advantages] + [cells[cell].get("own", "")]) + " |")
    return lines


def render(out: dict[str, Any], against: str | None = None) -> list[str]:
    """The markdown tables of a run, or of its saved ``--json`` (seeds there are strings);
    with ``against``, each part's paired table where that row is one of the part's rows."""
    a = out["args"]
    seeds = sorted(int(s) for s in a["seeds"].split(","))
    md: list[str] = []
    if "allocation" in out:
        runs = {k: {int(s): r for s, r in v.items()} for k, v in out["allocation"].items()}
        md += [f"### Allocation (frozen policy, difficulty {a['difficulty']}, M = {a['trajectories']}, {a['steps']} steps, "
               f"seeds {a['seeds']}; ranked by the effective sample ratio under grpo's advantage; mean ± 95% interval)", ""]
        md += allocation_table(runs) + [""]
        if against in runs:
            md += [f"Paired by seed against {against}:", ""] + allocation_paired(runs, against) + [""]
    if "learning_summary" in out:
        summary = out["learning_summary"]
        advs = tuple(x for x in a["advantages"].split(",") if x)
        g = summary["grpo"]
        md += [f"### Learning (ContrastLab learning mode, {'plain SGD' if a['sgd'] else 'scale-free steps'}, lr {a['lr']}, "
               f"shared lr {a['shared_lr']}, prefix weight {a.get('prefix_weight', 0.0)}, difficulty {a['difficulty']}, M = {a['trajectories']}, "
               f"{a['steps']} steps, seeds {a['seeds']}; held-out accuracy {g['initial_test_success']:.3f} at the start, "
               f"grpo ends at {statistics.fmean(g['final_test_success']):.3f}; ranked by the tokens needed to reach grpo's "
               "final held-out accuracy, as a multiple of grpo's; mean ± 95% interval)", ""]
        md += learning_table(summary) + ["", "The same, one column per advantage estimator:", ""]
        md += learning_pivot(summary, advs) + [""]
        if against in summary:
            md += [f"Paired by seed against {against}:", ""] + learning_paired(summary, seeds, against) + [""]
    return md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("both", "allocation", "learning"), default="both")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--trajectories", type=int, default=1024)
    ap.add_argument("--tasks", type=int, default=2048)
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--m-min", default="budget",
                    help="the grid cells' stage-1 group minimum (trace's m_min: an integer, 'budget' = the paper's 2, or "
                         "'half-group' = G/2, the default trace's; default: %(default)s)")
    ap.add_argument("--difficulty", default=DEFAULT_DIFFICULTY,
                    help="ContrastLab's root success distribution, as for `trace-gym bench allocators` (default: %(default)s)")
    ap.add_argument("--predictors", default=",".join(PREDICTORS))
    ap.add_argument("--advantages", default=",".join(ADVANTAGES), help="learning part: estimators of the grid cells")
    ap.add_argument("--lr", type=float, default=0.3, help="learning part: the simulated policy's per-task rate")
    ap.add_argument("--shared-lr", type=float, default=3.0, help="learning part: its shared-skill rate")
    ap.add_argument("--sgd", action="store_true", help="learning part: plain SGD steps (default: scale-free steps of RMS lr)")
    ap.add_argument("--prefix-weight", type=float, default=0.0,
                    help="learning part: count a turn shared by n trajectories n**W times (the trainer's loss.prefix_weight)")
    ap.add_argument("--no-grid", action="store_true", help="run the baselines only (no grid cells)")
    ap.add_argument("--rows", default="", help="only rows whose label contains one of these comma-separated strings")
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help="the rows beside the grid, comma-separated allocator specs, another predictor as "
                         "name[pred=spec] (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--from-json", default=None, help="render the tables of an earlier --json instead of running")
    ap.add_argument("--against", default=None, metavar="ROW",
                    help="also print every row minus ROW, paired by seed (a row label, e.g. pcl; in the learning part a "
                         "grid cell's label ends in ' adv=NAME')")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        if args.against and not any(args.against in saved.get(part, {}) for part in ("allocation", "learning")):
            ap.error(f"--against {args.against!r} is no row of {args.from_json}")
        print("\n".join(render(saved, args.against)))
        return
    predictors = tuple(p for p in args.predictors.split(",") if p)
    others = [p for p in predictors if p.split(":")[0] != "lm"]
    if not args.no_grid and len(others) < len(predictors):
        from trace_gym.predictors.lm import minilm_dir

        try:  # fail now, not in the first lm run
            minilm_dir()
        except FileNotFoundError as e:
            ap.error(f"{e}; or leave lm out: --predictors {','.join(others)}")
    m_min = int(args.m_min) if args.m_min.isdigit() else args.m_min
    rows = [] if args.no_grid else [{"label": c["label"], "spec": c["spec"], "grid": True} for c in grid_cells(predictors, m_min)]
    rows += [{"label": b, "spec": baseline_spec(b)} for b in args.baselines.split(",") if b]
    if args.rows:
        wanted = [w for w in args.rows.split(",") if w]
        rows = [r for r in rows if r["label"] == "grpo" or any(w in r["label"] for w in wanted)]
    advs = tuple(a for a in args.advantages.split(",") if a)
    if args.against:
        keys = {r["label"] for r in rows} | {f"{r['label']} adv={a}" for r in rows if r.get("grid") for a in advs}
        if args.against not in keys:
            ap.error(f"--against {args.against!r} is no row of this run; rows: {', '.join(sorted(keys))}")
    out: dict[str, Any] = {"args": vars(args)}
    t0 = time.perf_counter()
    if args.part in ("both", "allocation"):
        print(f"allocation part: {len(rows)} rows x {args.seeds} seeds", file=sys.stderr)
        out["allocation"] = run_part(args, 0.0, rows, (None,))
    if args.part in ("both", "learning"):
        print(f"learning part: {len(rows)} rows (grid cells x {len(advs)} advantages) x {args.seeds} seeds", file=sys.stderr)
        out["learning"] = run_part(args, args.lr, rows, advs)
        out["learning_summary"] = learning_summary(out["learning"])
    md = render(out, args.against)
    text = "\n".join(md)
    print(text)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
