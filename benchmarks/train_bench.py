"""Training benchmark: TRACE against GRPO at the same trajectory budget.

Two comparisons, both through :class:`trace_gym.trainers.RLTrainer`:

1. **ContrastLab learning mode** (seconds): the simulated policy learns from the advantages
   it is given; held-out success is exact (no sampling noise), so curves are clean.
2. **The quick preset on MathCalc** (minutes): the tiny from-scratch model, SFT warm start
   (cached; trained once), then RL with ``trace`` (TRACE allocation and tree-aware
   advantages) and ``grpo`` (groups of G, GRPO advantages) for the same steps and
   trajectories per step, over several seeds. Held-out accuracy (mean@k) is measured before
   RL and every few steps.

For each comparison it prints held-out accuracy against trajectories and against generated
tokens, the gain over the SFT start, and the *trajectory ratio*: trajectories TRACE needed
to first reach GRPO's final held-out accuracy, divided by GRPO's trajectories (the target is
at most 0.5), the same in tokens, and the held-out accuracy at equal tokens (TRACE's minus
GRPO's at the fewer of the two runs' last-evaluated tokens, each curve linear between its
evaluations: a figure that does not swing where the curves flatten). Figures and a JSON
summary go to ``--out``.

    python benchmarks/train_bench.py                      # both, 3 seeds, 2 worker processes
    python benchmarks/train_bench.py --only contrastlab   # the fast one
    python benchmarks/train_bench.py --seeds 0 --steps 10 # a shorter look
    python benchmarks/train_bench.py --only quick --out DIR --reuse --variants V  # add a row to DIR's runs

``--reuse`` trains only what ``--out`` lacks: a finished run of the same config (trace's and
grpo's, earlier variants) is kept, unless ``--out`` records another warm start's weights.
The quick preset's summary ends with every row's final held-out accuracy paired by seed
against grpo's and, with variants, against the default trace's (:func:`paired_finals`).

Runs share the machine: the thread count per worker is fixed (``--threads``) and reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from seed_stats import paired_table  # this script's own folder: run as a script, it is on sys.path
from trace_gym.leaderboard.paired import along_baseline, difference_at_equal_spend, ratio_to_baseline_final, t_interval
from trace_gym.leaderboard.render import markdown_table
from trace_gym.step import DISAGREEMENT_KINDS, disagreement_metric

ROOT = Path(__file__).resolve().parent.parent
ACC = "eval/{env}/mean@k"


def run_train(config: str, overrides: list[str], threads: int, log: Path) -> float:
    """One `trace-gym train` process; returns its wall time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-m", "trace_gym.cli", "train", "--config", config, *overrides,
                               f"model.threads={threads}", "log.progress=false"],
                              env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed, see {log}:\n" + log.read_text()[-2000:])
    return time.perf_counter() - t0


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def warm_start_dir(log: Path) -> Path:
    """The warm start's directory: the warm-start log's first word (OSError/IndexError when
    the log is missing or empty)."""
    return Path(log.read_text().split()[0])


def finished_run(run_dir: Path, config: str, overrides: list[str], threads: int) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly this config, so ``--reuse`` can keep
    it: its ``config.yaml`` has the fingerprint that ``config`` with ``overrides`` has (everything
    that shapes the training numbers, the warm start's SFT config included; not the output
    directory or logging) and its metrics reach the config's last step with a held-out
    evaluation there."""
    from trace_gym.trainers.config import load_config

    try:
        want = load_config(config, [*overrides, f"model.threads={threads}", "log.progress=false"])
        have = load_config(run_dir / "config.yaml")
        recs = run_records(run_dir)
    except (OSError, ValueError):
        return False
    last = [r for r in recs if r.get("step") == want.steps and any(k.startswith("eval/") for k in r)]
    return have.fingerprint() == want.fingerprint() and bool(last)


def weights_digest(warm_log: Path) -> str | None:
    """sha256 of the warm start's ``model.safetensors`` (:func:`warm_start_dir`), or None when it
    cannot be read."""
    import hashlib

    try:
        return hashlib.sha256((warm_start_dir(warm_log) / "model.safetensors").read_bytes()).hexdigest()
    except (OSError, IndexError):
        return None


def curve(run_dir: Path, env_name: str, key: str = "mean@k") -> dict[str, np.ndarray]:
    """Held-out accuracy of a run against cumulative trajectories and tokens, and its per-step
    effective ratio, effective sample ratio (under grpo's advantage), prompts sampled and its
    predictor's AUC at the roots and its branch flip rate (steps where they are defined)."""
    recs = run_records(run_dir)
    traj = {0: 0}
    tok = {0: 0}
    for r in recs:
        if "total/trajectories" in r:
            traj[r["step"]] = r["total/trajectories"]
            tok[r["step"]] = r["total/generated_tokens"]
    pts = [(r["step"], r[f"eval/{env_name}/{key}"]) for r in recs if f"eval/{env_name}/{key}" in r]
    steps = np.array([s for s, _ in pts])
    return {"step": steps, "trajectories": np.array([traj[s] for s in steps]), "tokens": np.array([tok[s] for s in steps]),
            "acc": np.array([a for _, a in pts], dtype=np.float64),
            "effective_ratio": np.array([r["effective_ratio"] for r in recs if "effective_ratio" in r]),
            # under grpo's advantage whatever the run trained with, so rows compare; runs logged before
            # the per-advantage ratios have only their own
            "effective_sample_ratio": np.array([r.get("effective_sample_ratio/grpo", r["effective_sample_ratio"])
                                                for r in recs if "effective_sample_ratio" in r]),
            "prompts": np.array([r["spent/prompts"] for r in recs if "effective_ratio" in r and "spent/prompts" in r]),
            # how well the predictor ranked the step's prompts before their outcomes (rows without one: empty)
            # (null where the step's roots were all alike)
            "root_auc": np.array([r["predictor/root_auc"] for r in recs
                                  if r.get("predictor/root_auc") is not None and np.isfinite(r["predictor/root_auc"])]),
            # of the branches in trees whose root rollouts agreed, the share that flipped (steps with such branches)
            "flip_rate": np.array([r["branch/flip_rate"] for r in recs if r.get("branch/flip_rate") is not None]),
            # continuations from pure prefixes: the predictor's chance that one disagrees with what the
            # prefix had shown, and the share that did (fresh rollouts of a pure prompt; turn-level prefixes)
            **{f"{kind}_disagree": np.array([(r[disagreement_metric(kind, "pred")], r[disagreement_metric(kind, "seen")])
                                             for r in recs if r.get(disagreement_metric(kind, "seen")) is not None]).reshape(-1, 2)
               for kind in DISAGREEMENT_KINDS}}


def ratio_to_grpo_final(tc: dict[str, np.ndarray], gc: dict[str, np.ndarray], key: str) -> float:
    """Trajectories (``key="trajectories"``) or tokens curve ``tc`` needs to first reach the
    final accuracy of grpo's curve ``gc``, over grpo's (inf: never reached). NaN where grpo
    ended no higher than it started: there is no gain to reach, and a row from the same start
    would "reach" it at 0."""
    return ratio_to_baseline_final(tc[key], tc["acc"], gc["acc"], float(gc[key][-1]))


def accuracy_over_grpo_at_equal_tokens(tc: dict[str, np.ndarray], gc: dict[str, np.ndarray]) -> float:
    """Held-out accuracy of curve ``tc`` minus grpo's curve ``gc``, at the fewer of the two's
    last tokens, each curve linear between its evaluations (the leaderboard's
    :func:`~trace_gym.leaderboard.paired.difference_at_equal_spend`)."""
    return difference_at_equal_spend(tc["tokens"], tc["acc"], gc["tokens"], gc["acc"])


def mean_curve_ratio(tcs: list[dict[str, np.ndarray]], gcs: list[dict[str, np.ndarray]], key: str) -> float:
    """:func:`ratio_to_grpo_final` on the seed-averaged curves."""
    def avg(cs):
        return {"acc": np.mean([c["acc"] for c in cs], axis=0), "trajectories": cs[0]["trajectories"],
                "tokens": np.mean([c["tokens"] for c in cs], axis=0)}
    return ratio_to_grpo_final(avg(tcs), avg(gcs), key)


def bootstrap_interval(tcs, gcs, key: str, resamples: int = 2000, target: float = 0.6) -> dict[str, float]:
    """95% percentile interval of :func:`mean_curve_ratio` over seeds resampled with
    replacement (seed i's trace and grpo runs together), and the share of resamples at or
    below ``target``. A bound is inf when more than 2.5% of resamples never reach grpo; a
    resample in which grpo's mean curve does not gain counts as never reaching it."""
    rng = np.random.default_rng(0)
    n = len(tcs)
    vals = np.array([mean_curve_ratio([tcs[i] for i in idx], [gcs[i] for i in idx], key)
                     for idx in (rng.integers(0, n, n) for _ in range(resamples))])
    lo, hi = np.percentile(np.where(np.isfinite(vals), vals, np.finfo(float).max), [2.5, 97.5])
    big = np.finfo(float).max / 2
    return {"low": float(lo) if lo < big else float("inf"), "high": float(hi) if hi < big else float("inf"),
            "share_at_most_target": float(np.mean(vals <= target)), "target": target}


def compare(curves: dict[str, list[dict[str, np.ndarray]]]) -> dict[str, Any]:
    """Per-seed and mean figures of trace against grpo."""
    out: dict[str, Any] = {"seeds": []}
    for tc, gc in zip(curves["trace"], curves["grpo"]):
        target = float(gc["acc"][-1])
        out["seeds"].append({
            "start": float(tc["acc"][0]), "trace_final": float(tc["acc"][-1]), "grpo_final": target,
            "trace_gain": float(tc["acc"][-1] - tc["acc"][0]), "grpo_gain": float(gc["acc"][-1] - gc["acc"][0]),
            "trajectory_ratio": ratio_to_grpo_final(tc, gc, "trajectories"),
            "token_ratio": ratio_to_grpo_final(tc, gc, "tokens"),
            "trace_effective_ratio": float(tc["effective_ratio"].mean()), "grpo_effective_ratio": float(gc["effective_ratio"].mean()),
            "trace_effective_sample_ratio": float(tc["effective_sample_ratio"].mean()),
            "grpo_effective_sample_ratio": float(gc["effective_sample_ratio"].mean()),
            "trace_tokens": int(tc["tokens"][-1]), "grpo_tokens": int(gc["tokens"][-1]),
            "equal_tokens_diff": accuracy_over_grpo_at_equal_tokens(tc, gc),
            # each later evaluation of trace against grpo's curve at its tokens: where the
            # curves flatten together the final figure alone says nothing of the way there
            "along_grpo_curve": along_baseline(tc["tokens"], tc["acc"], gc["tokens"], gc["acc"])[1:],
            "eval_steps": [int(x) for x in tc.get("step", range(len(tc["acc"])))[1:]],
        })
    ratios = ("trajectory_ratio", "token_ratio")
    mean = {k: float(np.mean([s[k] for s in out["seeds"]])) for k in out["seeds"][0] if k not in ratios}
    for k in ratios:
        defined = [s[k] for s in out["seeds"] if not math.isnan(s[k])]
        mean[k] = float(np.median(defined)) if defined else math.nan
    # the same ratio on the seed-averaged curves
    mean["trajectory_ratio_of_mean_curves"] = mean_curve_ratio(curves["trace"], curves["grpo"], "trajectories")
    mean["token_ratio_of_mean_curves"] = mean_curve_ratio(curves["trace"], curves["grpo"], "tokens")
    mean["token_ratio_interval"] = bootstrap_interval(curves["trace"], curves["grpo"], "tokens")
    mean["trajectory_ratio_interval"] = bootstrap_interval(curves["trace"], curves["grpo"], "trajectories", target=0.5)
    diffs = [s["equal_tokens_diff"] for s in out["seeds"]]
    mean["equal_tokens_diff"], mean["equal_tokens_half_width"] = t_interval(diffs)
    mean["equal_tokens_ahead"] = sum(d > 0 for d in diffs)
    along = [s["along_grpo_curve"] for s in out["seeds"]]
    if len({len(a) for a in along}) == 1 and len({tuple(s["eval_steps"]) for s in out["seeds"]}) == 1:
        # NaN: trace had spent more than grpo's last-evaluated tokens there
        defined = [[d for d in col if not math.isnan(d)] for col in zip(*along)]
        mean["along_grpo_curve"] = [[*t_interval(col), sum(d > 0 for d in col)] if col else [math.nan, math.nan, 0]
                                    for col in defined]
        mean["eval_steps"] = out["seeds"][0]["eval_steps"]
    out["mean"] = mean
    return out


def contrast_table(curves: dict[str, list[dict[str, np.ndarray]]]) -> list[str]:
    """Markdown: per row, the prompts it sampled a step, how many of them were mixed (both a
    success and a failure: the prompts with contrast), its effective sample ratio under
    grpo's advantage, its predictor's AUC at the roots (blank without a predictor), the share of its
    branches in trees whose root rollouts agreed that flipped the outcome (``branch/flip_rate``;
    blank for a row that never branches or runs logged before the metric), how often its
    continuations from pure prefixes were predicted to disagree with the outcome the prefix had
    shown and how often they did (``branch/{root,inner}_disagree_{pred,seen}``: fresh rollouts of a
    still-pure prompt, continuations of a turn-level prefix; blank likewise) and its final
    held-out accuracy, means over seeds and steps; then how the final accuracy follows the
    other columns over the rows (Pearson r of the row means)."""
    head = ["row", "prompts a step", "mixed prompts a step", "ESR (grpo adv.)", "root AUC", "branches flipping a pure tree",
            "pure prompt, fresh rollout: disagrees pred. / seen", "pure turn-level prefix, continuation: disagrees pred. / seen",
            "final acc."]
    lines = ["### Contrast: on how many prompts, and on how many trajectories", "", *markdown_table(head)]
    cols: dict[str, list[float]] = {"mixed": [], "esr": [], "final": []}
    for name, cs in curves.items():
        runs = [c for c in cs if c["prompts"].size]
        if not runs:  # runs logged before prompts were recorded
            continue
        prompts = float(np.mean([c["prompts"].mean() for c in runs]))
        mixed = float(np.mean([(c["prompts"] * c["effective_ratio"][: c["prompts"].size]).mean() for c in runs]))
        esr, final = float(np.mean([c["effective_sample_ratio"].mean() for c in runs])), float(np.mean([c["acc"][-1] for c in runs]))
        for k, v in (("mixed", mixed), ("esr", esr), ("final", final)):
            cols[k].append(v)
        aucs = [c["root_auc"].mean() for c in runs if c.get("root_auc", np.zeros(0)).size]
        auc = f"{np.mean(aucs):.2f}" if aucs else ""
        flips = [c["flip_rate"].mean() for c in runs if c.get("flip_rate", np.zeros(0)).size]
        flip = f"{100 * np.mean(flips):.1f}%" if flips else ""
        disagree = []
        for kind in DISAGREEMENT_KINDS:
            steps = [c[f"{kind}_disagree"] for c in runs if c.get(f"{kind}_disagree", np.zeros((0, 2))).size]
            pred, seen = np.mean([x.mean(axis=0) for x in steps], axis=0) if steps else (None, None)
            disagree.append(f"{100 * pred:.1f}% / {100 * seen:.1f}%" if steps else "")
        lines.append(f"| {name} | {prompts:.2f} | {mixed:.2f} | {esr:.3f} | {auc} | {flip} | {disagree[0]} | {disagree[1]} | {final:.3f} |")
    if len(cols["final"]) >= 3:
        r = {k: float(np.corrcoef(cols[k], cols["final"])[0, 1]) for k in ("mixed", "esr")}
        lines += ["", f"over the {len(cols['final'])} rows, Pearson r of the final accuracy with the mixed prompts a step "
                      f"{r['mixed']:+.2f}, with the ESR {r['esr']:+.2f}"]
    return lines + [""]


def paired_finals(finals: dict[str, dict[int, float]]) -> list[str]:
    """Markdown: each row's mean final held-out accuracy, then every row minus grpo's on the
    same seed and, when there are variants, every row minus the default trace's (``"trace"``):
    mean ± 95% t-interval and the seeds the row is ahead on. What the seeds share (the warm
    start's evaluation draw, the tasks) drops out of a paired difference."""
    lines = ["### Final held-out accuracy, paired by seed", "",
             "means: " + ", ".join(f"{k} {np.mean(list(v.values())):.3f}" for k, v in finals.items()), ""]
    for against in ("grpo", "trace") if len(finals) > 2 else ("grpo",):
        lines += paired_table(finals, against, "final acc.", digits=3) + [""]
    return lines


def plot(curves: dict[str, list[dict[str, np.ndarray]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x in zip(axes, ("trajectories", "tokens")):
        for name, color in (("trace", "tab:red"), ("grpo", "tab:blue")):
            for i, c in enumerate(curves[name]):
                ax.plot(c[x], c["acc"], color=color, alpha=0.3, lw=1)
            xs = np.mean([c[x] for c in curves[name]], axis=0)
            ax.plot(xs, np.mean([c["acc"] for c in curves[name]], axis=0), color=color, lw=2.5, label=f"{name} (mean of {len(curves[name])} seeds)")
        ax.set_xlabel(f"{x} spent")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict(ratio: float, target: float) -> str:
    if math.isnan(ratio):
        return f"target <= {target}: n/a, grpo's mean curve ended no higher than it started"
    return f"target <= {target}: {'met' if ratio <= target else 'MISSED'}"


def report(name: str, cmp: dict[str, Any], seconds: float) -> list[str]:
    lines = [f"## {name}", "", "| seed | SFT/start | trace final | grpo final | trace gain | grpo gain | trace ER | grpo ER | trace ESR (grpo adv.) | grpo ESR | trajectory ratio | token ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(cmp["seeds"]):
        lines.append(f"| {i} | {s['start']:.3f} | {s['trace_final']:.3f} | {s['grpo_final']:.3f} | {s['trace_gain']:+.3f} | {s['grpo_gain']:+.3f} | "
                     f"{s['trace_effective_ratio']:.2f} | {s['grpo_effective_ratio']:.2f} | {s['trace_effective_sample_ratio']:.2f} | "
                     f"{s['grpo_effective_sample_ratio']:.2f} | {s['trajectory_ratio']:.2f} | {s['token_ratio']:.2f} |")
    m = cmp["mean"]
    lines += ["", f"mean: start {m['start']:.3f}, trace {m['trace_final']:.3f} ({m['trace_gain']:+.3f}), grpo {m['grpo_final']:.3f} ({m['grpo_gain']:+.3f}); "
              f"trajectory ratio median {m['trajectory_ratio']:.2f}, on the mean curves {m['trajectory_ratio_of_mean_curves']:.2f} "
              f"({_verdict(m['trajectory_ratio_of_mean_curves'], 0.5)}); token ratio on the mean curves "
              f"{m['token_ratio_of_mean_curves']:.2f} ({_verdict(m['token_ratio_of_mean_curves'], 0.6)}); "
              f"tokens spent trace {m['trace_tokens']:.0f} vs grpo {m['grpo_tokens']:.0f}; wall {seconds:.0f} s",
              "95% bootstrap intervals over seeds (inf: more than 2.5% of resamples never reach grpo's final accuracy): "
              + "; ".join(f"{k.split('_')[0]} ratio [{m[k]['low']:.2f}, {m[k]['high']:.2f}], {m[k]['share_at_most_target']:.0%} of "
                          f"resamples <= {m[k]['target']}" for k in ("token_ratio_interval", "trajectory_ratio_interval")),
              f"held-out accuracy at equal tokens (trace's minus grpo's at the fewer of the two runs' last-evaluated tokens, "
              f"both linear between evaluations): {m['equal_tokens_diff']:+.3f}"
              + ("" if math.isnan(m["equal_tokens_half_width"]) else f" ± {m['equal_tokens_half_width']:.3f} (95% t over seeds)")
              + f", trace ahead on {m['equal_tokens_ahead']} of {len(cmp['seeds'])} seeds"]
    if m.get("along_grpo_curve"):
        lines.append("trace after each evaluated step minus grpo's curve at the same tokens (95% t over seeds; seeds ahead): "
                     + ", ".join(f"step {st} n/a (beyond grpo's tokens)" if math.isnan(d) else
                                 f"step {st} {d:+.3f}" + ("" if math.isnan(h) else f" ± {h:.3f}") + f" ({a})"
                                 for st, (d, h, a) in zip(m["eval_steps"], m["along_grpo_curve"])))
    return lines + [""]


CL_VARIANTS = {
    # name: overrides; "grpo" is the baseline every other variant is compared with
    "grpo": ["allocator.name=grpo", "advantage=grpo"],
    "trace": ["allocator.name=trace", "advantage=trace"],
    "trace+tree_grpo": ["allocator.name=trace", "advantage=tree_grpo"],
}


def contrastlab(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], list[str]]:
    """ContrastLab learning mode: the same trainer with model.name=sim, several TRACE variants."""
    import shutil

    t0 = time.perf_counter()
    cfg = ROOT / "configs" / "contrastlab.yaml"
    jobs = []
    for seed in args.seeds:
        for name, over in CL_VARIANTS.items():
            d = out / f"contrastlab-{name.replace('+', '-')}-s{seed}"
            if d.exists():
                shutil.rmtree(d)
            jobs.append((name, seed, d, [f"seed={seed}", f"output_dir={d}", *over]))
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda j: run_train(str(cfg), j[3], 1, out / f"{j[2].name}.log"), jobs))
    curves: dict[str, list] = {name: [] for name in CL_VARIANTS}
    for name, _, d, _ in jobs:
        curves[name].append(curve(d, "ContrastLab-v0", "exact_success"))
    seconds = time.perf_counter() - t0
    result, lines = {}, []
    for name in CL_VARIANTS:
        if name == "grpo":
            continue
        cmp = compare({"trace": curves[name], "grpo": curves["grpo"]})
        result[name] = cmp
        lines += report(f"ContrastLab learning mode, {name} vs grpo (exact held-out success)", cmp, seconds)
        plot({"trace": curves[name], "grpo": curves["grpo"]}, f"ContrastLab learning mode: {name} vs grpo (exact held-out success)",
             out / f"contrastlab-{name.replace('+', '-')}.png")
    result["mean"] = result["trace"]["mean"]
    return result, lines


def versions_text(versions: dict[str, str]) -> str:
    """``{"torch": "2.13.0"}`` as ``"torch 2.13.0"``, comma-separated ("not recorded" when empty)."""
    return ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded"


def warm_start_versions(log: Path) -> dict[str, str]:
    """The package versions a warm start was trained with, from its ``sft_summary.json``
    (:func:`warm_start_dir`); empty when not recorded."""
    try:
        summary = warm_start_dir(log) / "sft_summary.json"
        return json.loads(summary.read_text()).get("versions", {})
    except (OSError, IndexError, ValueError):
        return {}


def quick(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], list[str]]:
    """The quick preset on MathCalc: SFT once (cached), then trace and grpo per seed."""
    cfg = str(ROOT / "configs" / "quick.yaml")
    t0 = time.perf_counter()
    # the warm start first, alone (the workers then find it cached); it trains with the
    # config's sft.threads, whatever --threads says, so every caller builds the same one
    warm = out / "quick-sft.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads * args.workers), HF_HUB_OFFLINE="1")
    if not args.report_only:
        code = ("import sys, time; from trace_gym.trainers.config import load_config; from trace_gym.trainers.sft import warm_start;"
                "c = load_config(sys.argv[1], sys.argv[2:]); t = time.time();"
                "d = warm_start(c.model.name, c.sft.sft(), tiny=c.model.tiny); print(d, round(time.time() - t, 1))")
        with open(warm, "w") as fh:
            subprocess.run([sys.executable, "-c", code, cfg, *args.set], env=env, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    t_sft = time.perf_counter() - t0
    # --reuse keeps finished runs only if they were trained from these very weights: a warm
    # start rebuilt under the same key on another machine can differ (README, "Measured")
    digest_file, reuse, reuse_note = out / "quick-warm-start.json", args.reuse and not args.report_only, None
    digest = None if args.report_only else weights_digest(warm)
    if reuse:
        earlier = json.loads(digest_file.read_text()).get("sha256") if digest_file.exists() else None
        if earlier is None:
            reuse_note = "reused runs: their warm start was not recorded in --out, taken on trust"
        elif earlier != digest:
            reuse, reuse_note = False, "nothing reused: the runs in --out were trained from another warm start"
    if digest is not None:
        digest_file.write_text(json.dumps({"warm_start": str(warm_start_dir(warm)), "sha256": digest}, indent=1))
    jobs, reused = [], 0
    extra = ([f"steps={args.steps}"] if args.steps else []) + list(args.set)
    # the config's allocator (the default trace), other allocator specs (--variants), grpo
    variants = [("trace", [])] + [(v, v.split(";")) for v in args.variants]
    for seed in args.seeds:
        for alloc, over in variants + [("grpo", ["allocator.name=grpo", "advantage=grpo"])]:
            d = out / f"quick-{''.join(c if c.isalnum() else '-' for c in alloc)}-s{seed}"
            overrides = [f"seed={seed}", f"output_dir={d}", "log.tensorboard=false", *extra, *over]
            keep = args.report_only or (reuse and finished_run(d, cfg, overrides, args.threads))
            reused += bool(keep and reuse)
            if d.exists() and not keep:
                import shutil

                shutil.rmtree(d)
            jobs.append((alloc, seed, d, overrides, keep))
    t1 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda j: run_train(cfg, j[3], args.threads, out / f"{j[2].name}.log"), [j for j in jobs if not j[4]]))
    t_rl = time.perf_counter() - t1
    curves: dict[str, list] = {name: [] for name, _ in variants + [("grpo", [])]}
    finals: dict[str, dict[int, float]] = {name: {} for name in curves}
    for alloc, seed, d, _, _ in jobs:
        curves[alloc].append(curve(d, "MathCalc-v0"))
        finals[alloc][seed] = float(curves[alloc][-1]["acc"][-1])
    lines = []
    for name, _ in variants:
        c = compare({"trace": curves[name], "grpo": curves["grpo"]})
        c["seconds"] = {"sft_warm_start": t_sft, "rl_runs": t_rl}
        if name == "trace":
            cmp = c
            plot({"trace": curves[name], "grpo": curves["grpo"]}, "quick preset on MathCalc: held-out accuracy (mean@k)", out / "quick.png")
        else:
            cmp.setdefault("variants", {})[name] = c
        lines += report(f"Quick preset: tiny model on MathCalc (held-out mean@k), {name} (in the 'trace' columns) vs grpo", c, t_rl)
    lines.insert(-1, f"SFT warm start {t_sft:.0f} s (0 when cached); RL runs {t_rl:.0f} s with {args.workers} workers x {args.threads} thread(s)")
    lines.insert(-1, "warm start trained with: " + versions_text(warm_start_versions(warm)))
    if args.reuse or reuse_note:
        lines.insert(-1, f"{reused} of {len(jobs)} runs reused from --out (finished, same config fingerprint)"
                     + (f"; {reuse_note}" if reuse_note else ""))
    cmp["finals"] = finals
    return cmp, lines + paired_finals(finals) + contrast_table(curves)


def smollm2(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], list[str]]:
    """SmolLM2-135M with the quick preset's recipe: zero-shot, after the SFT warm start, after a few RL steps."""
    import shutil

    cfg = str(ROOT / "configs" / "smollm2.yaml")
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads * args.workers), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    zero = out / "smollm2-zero-shot.json"
    with open(out / "smollm2-zero-shot.log", "w") as fh:
        subprocess.run([sys.executable, "-m", "trace_gym.cli", "eval", "--config", cfg, "--model", "smollm2-135m", "--json", str(zero),
                        f"model.threads={args.threads * args.workers}"], env=env, stdout=fh, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    t_zero = time.perf_counter() - t0
    run = out / "smollm2-run"
    if run.exists():
        shutil.rmtree(run)
    t1 = time.perf_counter()
    run_train(cfg, [f"output_dir={run}", "log.tensorboard=false"], args.threads * args.workers, out / "smollm2-run.log")
    t_run = time.perf_counter() - t1
    z = json.loads(zero.read_text())["envs"]["trace_gym/MathCalc-v0"]
    recs = run_records(run)
    evals = [r for r in recs if "eval/MathCalc-v0/mean@k" in r]
    steps = [r for r in recs if "effective_ratio" in r]
    pick = lambda r: {"accuracy": r["eval/MathCalc-v0/mean@k"], "tool_call_rate": r["eval/MathCalc-v0/tool_call_rate"],  # noqa: E731
                      "answer_rate": r["eval/MathCalc-v0/answer_rate"]}
    result = {"zero_shot": {"accuracy": z["mean@k"], "tool_call_rate": z["tool_call_rate"], "answer_rate": z["answer_rate"]},
              "after_sft": pick(evals[0]), "after_rl": pick(evals[-1]), "rl_steps": len(steps),
              "rl_step_seconds": [r["time/step"] for r in steps], "effective_ratio": [r["effective_ratio"] for r in steps],
              "seconds": {"zero_shot_eval": t_zero, "sft_and_rl": t_run}}
    lines = ["## SmolLM2-135M-Instruct, the quick recipe (held-out MathCalc levels 1-5, 40 tasks, k=1)", "",
             "| stage | accuracy | tool-call rate | answer rate |", "|---|---|---|---|"]
    for name in ("zero_shot", "after_sft", "after_rl"):
        r = result[name]
        lines.append(f"| {name.replace('_', ' ')} | {r['accuracy']:.3f} | {r['tool_call_rate']:.2f} | {r['answer_rate']:.2f} |")
    lines += ["", f"{len(steps)} RL steps, {np.mean(result['rl_step_seconds']):.0f} s per step; zero-shot eval {t_zero:.0f} s, "
              f"SFT (cached after the first run) + RL + evals {t_run:.0f} s", ""]
    return result, lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="RL steps of the quick preset (default: the config's)")
    p.add_argument("--workers", type=int, default=2, help="training processes at a time")
    p.add_argument("--variants", nargs="*", default=[],
                   help="quick preset: more runs beside the config's trace and grpo, each compared with grpo; one variant is "
                        "';'-separated config overrides, e.g. 'allocator=trace:root_fraction=0.25' 'advantage=tree_grpo'")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="quick preset: a config override for every run and the warm start, repeatable "
                        "(e.g. sft.threads=2 for the two-thread warm start)")
    p.add_argument("--only", choices=["contrastlab", "quick", "smollm2"], default=None,
                   help="run one part (default: contrastlab and quick; smollm2 only when asked, it is slow on CPU)")
    p.add_argument("--out", default=str(ROOT / "results" / "train_bench"))
    p.add_argument("--report-only", action="store_true",
                   help="quick preset: train nothing, report the runs already in --out (same seeds and variants)")
    p.add_argument("--reuse", action="store_true",
                   help="quick preset: keep the finished runs already in --out whose config is this command's "
                        "(same fingerprint) instead of training them again; refused when --out records another warm start")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from trace_gym.provenance import cpu_info, package_versions

    # a real model's warm start depends on the install and the CPU (README, "Training on the quick preset"): say which
    versions, cpu = package_versions(), cpu_info()
    summary: dict[str, Any] = {"seeds": args.seeds, "workers": args.workers, "threads": args.threads, "set": args.set, "cpus": os.cpu_count(),
                               "versions": versions, "cpu": cpu}
    lines = [f"# train_bench ({len(args.seeds)} seeds, {args.workers} workers x {args.threads} thread(s), {os.cpu_count()} CPUs)", "",
             "installed: " + versions_text(versions), "cpu: " + ", ".join(cpu.values()), ""]
    t0 = time.perf_counter()
    if args.only in (None, "contrastlab"):
        summary["contrastlab"], more = contrastlab(args, out)
        lines += more
    if args.only in (None, "quick"):
        summary["quick"], more = quick(args, out)
        lines += more
    if args.only == "smollm2":
        summary["smollm2"], more = smollm2(args, out)
        lines += more
    summary["seconds"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    parts = []
    for name in ("contrastlab", "quick"):
        if name in summary:
            m = summary[name]["mean"]
            parts.append(f"{name}_trace_gain={m['trace_gain']:.3f} {name}_grpo_gain={m['grpo_gain']:.3f} "
                         f"{name}_trajectory_ratio={m['trajectory_ratio_of_mean_curves']:.2f}")
    print(" ".join(parts) + f" total_s={summary['seconds']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
