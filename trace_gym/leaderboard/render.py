"""Leaderboard output: Markdown, a rich terminal table, PNG plots and a self-contained HTML page.

Everything here reads ranked :class:`~trace_gym.leaderboard.records.Group` objects, so a
fresh run and a merge of several runs render identically. Plots use matplotlib's Agg
backend (no display needed); the HTML embeds them as base64 PNGs so the page is one file
that can be mailed or attached to a paper's supplement.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Sequence

import numpy as np

from trace_gym.leaderboard.records import LOWER_IS_BETTER, PROMPT_COUNTS, TABLE_METRICS, Group, Row

METRIC_LABELS = {
    "effective_sample_ratio/grpo": "eff. sample ratio (grpo adv.)",
    "effective_sample_ratio": "eff. sample ratio (own adv.)",
    "effective_ratio": "eff. ratio",
    "prompts": "prompts/step",
    "mixed_prompts": "mixed prompts/step",
    "effective_token_ratio": "eff. token ratio",
    "branch_flip_rate": "branch flips",
    "auc_prefix": "AUC prefixes (eval set)",
    "auc_root": "AUC roots (eval set)",
    "brier_prefix": "Brier prefixes (eval set)",
    "brier_root": "Brier roots (eval set)",
    "brier": "Brier (own nodes)",
    "ece": "ECE (own nodes)",
    "auc": "AUC (own nodes)",
    "accuracy": "held-out acc.",
    "accuracy_gain": "acc. gain",
    "pass_at_k": "pass@k",
    "reward_mean": "reward",
    "failed_share": "failed",
}

PLOTS = {"effective_ratio": "effective_ratio.png", "accuracy": "accuracy_vs_budget.png"}
"""The PNG files a leaderboard writes (those whose tracks are present)."""


def _fmt(mean: float | None, std: float | None, n: int, digits: int = 3) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 and std is not None else f"{mean:.{digits}f}"



def _per_seed(spend: list[tuple[int, int]]) -> str:
    values = sorted({t for _, t in spend})
    return f"{values[0]:,}" if len(values) == 1 else " / ".join(f"{t:,}" for _, t in spend)


def _metrics(group: Group) -> list[str]:
    present = {m for row in group.rows for m, v in row.mean.items() if v is not None}
    return [m for m in TABLE_METRICS[group.kind] if m in present]


def _advantage(row: Row) -> str:
    """The advantage estimator(s) under which a row's sample ratios were computed."""
    return ", ".join(sorted({r.record.advantage for r in row.records}))


def _usual_spend(group: Group) -> list[tuple[int, int]] | None:
    """The spend per seed most rows share (None when no spend is shared by more rows than any other)."""
    spends = [tuple(row.spend_by_seed()) for row in group.rows]
    counts = sorted((spends.count(s) for s in set(spends)), reverse=True)
    if not spends or (len(counts) > 1 and counts[0] == counts[1]):
        return None
    return list(max(spends, key=spends.count))


def _table(group: Group) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a group's table: rank, allocator, seeds, the final metrics, spend per
    seed (``*`` where a row's spend differs from the other rows'), tokens per seed, and the
    advantage estimator that produced the row's sample ratios (``adv.``)."""
    metrics = _metrics(group)
    head = ["rank", "allocator", "seeds"] + [METRIC_LABELS.get(m, m) + (" ↓" if m in LOWER_IS_BETTER else "") for m in metrics] \
        + ["trajectories/seed", "tokens/seed", "adv."]
    usual = _usual_spend(group)
    body = []
    for row in group.rows:
        n = len(row.records)
        flag = "*" if row.spend_by_seed() != usual else ""
        body.append([str(row.rank), row.allocator, str(n)] + [_fmt(row.mean.get(m), row.std.get(m), n, 2 if m in PROMPT_COUNTS else 3) for m in metrics]
                    + [_per_seed(row.spend_by_seed()) + flag, f"{round(row.tokens / max(n, 1)):,}", _advantage(row)])
    return head, body


def _budget_line(group: Group) -> str:
    b = group.budget
    same = all(row.spend_by_seed() == _usual_spend(group) for row in group.rows)
    spend = ("every row spent the same trajectories" if same else
             "* marks rows that spent different trajectories than the others: compare them with care")
    return (f"budget: M = {b.trajectories_per_step} trajectories/step x {b.steps} steps, {b.candidates} candidate prompts/step; "
            f"ranked by {METRIC_LABELS.get(group.rank_metric, group.rank_metric)}; {spend}")


LEGEND = {
    "effective_sample_ratio/grpo": "eff. sample ratio (grpo adv.): share of trajectories with a non-zero advantage under grpo's estimator, one estimator for every row",
    "effective_sample_ratio": "eff. sample ratio (own adv.): share of trajectories with a non-zero advantage under the row's advantage estimator (adv.)",
    "effective_token_ratio": "eff. token ratio: the same share of generated policy tokens",
    "effective_ratio": "eff. ratio: share of sampled prompts whose tree holds both a success and a failure",
    "branch_flip_rate": "branch flips: of the branches in trees whose rollouts from the root all agreed, the share that "
                        "ended with the other outcome, the contrast branching bought (n/a: the row never branched in such a tree)",
    "prompts": "prompts/step: prompts sampled a step; mixed prompts/step: of them, those whose tree holds both a success "
               "and a failure (prompts x eff. ratio), the prompts whose trajectories carry grpo's advantage",
    "auc_prefix": "AUC and Brier prefixes/roots (eval set): the row's predictor after its run, on the same histories for "
                  "every row, prefixes (non-terminal inner nodes) and roots apart, against the exact V (n/a: it has none; "
                  "oracle rows are scored with the exact V)",
    "brier": "Brier, ECE, AUC (own nodes): the row's predictor against outcomes on the nodes it predicted during its run; "
             "each row chose its own nodes, so these do not compare between rows (n/a: it has none)",
    "accuracy": "held-out acc.: mean@k on held-out tasks after the last step",
    "accuracy_gain": "acc. gain: held-out acc. minus that of the starting policy",
    "pass_at_k": "pass@k: share of held-out tasks solved at least once in k samples",
    "reward_mean": "reward: mean reward of the step's trajectories",
    "failed_share": "failed: share of the row's trajectories that failed (a generation or env error; counted as spent, "
                    "with no outcome): its figures rest on fewer trajectories, and the run's log names the errors",
}


_LEGEND_ALIASES = {"mixed_prompts": "prompts", "auc_root": "auc_prefix", "brier_prefix": "auc_prefix", "brier_root": "auc_prefix", "ece": "brier",
                   "auc": "brier"}
"""Metrics explained by another one's legend entry."""


def _span(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,.0f}" if lo == hi else f"{lo:,.0f}-{hi:,.0f}"


def evaluation_set_line(group: Group) -> str | None:
    """What a group's shared evaluation set was (from its records' ``eval_*`` and
    ``bayes_auc_*`` finals): its size per seed and its Bayes-optimal AUC, or a warning when
    records of one seed were scored on different sets. None when no record has one."""
    per_seed: dict[int, set[tuple]] = {}
    for row in group.rows:
        for lr in row.records:
            f = lr.record.final
            if f.get("eval_roots") is not None:
                per_seed.setdefault(lr.record.seed, set()).add(
                    (f["eval_roots"], f.get("eval_prefixes"), f.get("bayes_auc_prefix"), f.get("bayes_auc_root")))
    if not per_seed:
        return None
    if any(len(sets) > 1 for sets in per_seed.values()):
        return ("eval set: rows of one seed were scored on different evaluation sets (records from other versions or "
                "settings): compare their AUC and Brier with care")
    sets = [next(iter(v)) for v in per_seed.values()]
    line = (f"eval set: one per seed, shared by every row ({_span([s[0] for s in sets])} roots and "
            f"{_span([s[1] for s in sets if s[1] is not None] or [0])} prefixes per seed)")
    bayes = [s[2] for s in sets if s[2] is not None], [s[3] for s in sets if s[3] is not None]
    if bayes[0]:
        line += ("; Bayes-optimal AUC on it (the most a predictor given the history can reach; oracle rows, scored "
                 f"with the exact V, may exceed it): {np.mean(bayes[0]):.3f} prefixes"
                 + (f" / {np.mean(bayes[1]):.3f} roots" if bayes[1] else ""))
    return line


def legend_line(group: Group) -> str:
    """One line that explains every abbreviation of a group's table (with the group's shared
    evaluation set and its Bayes-optimal AUC, where it has one)."""
    parts = []
    for m in _metrics(group):
        entry = LEGEND.get(_LEGEND_ALIASES.get(m, m))
        if entry and entry not in parts:
            parts.append(entry)
    evaluation = evaluation_set_line(group) if {"auc_prefix", "auc_root", "brier_prefix", "brier_root"} & set(_metrics(group)) else None
    if evaluation:
        parts.append(evaluation)
    if "effective_sample_ratio" not in _metrics(group):
        parts.insert(0, "adv.: the advantage estimator of the row's trajectories")
    parts += ["↓: lower is better", "x ± y: mean ± standard deviation over seeds",
              "trajectories/seed: spent per seed (one figure when all seeds spent the same)"]
    return "; ".join(parts) + "."


def paired_sections(group: Group, against: str | None) -> list[tuple[str, list[str], list[list[str]], str]]:
    """``(title, header, cells, legend)`` of each table of the group's rows against ``against``
    paired by seed (:mod:`trace_gym.leaderboard.paired`): the final figures, then for a
    training group the same rows along the run (:func:`~trace_gym.leaderboard.paired.along_table`).
    Empty without ``against``, when the group has no such row, or when no other row shares a
    seed with it."""
    from trace_gym.leaderboard.paired import (
        ALONG_LEGEND, EQUAL_TOKENS_LEGEND, EVAL_NOISE, EVAL_NOISE_LEGEND, PAIRED_LEGEND, along_table, paired, paired_table,
    )

    if not against or all(r.allocator != against for r in group.rows):
        return []
    rows = paired(group, against)
    head, body = paired_table(group, against, rows)
    if not body:
        return []
    legend = (PAIRED_LEGEND.format(row=against) + (EQUAL_TOKENS_LEGEND.format(row=against) if group.kind == "training" else "")
              + (EVAL_NOISE_LEGEND if EVAL_NOISE in head else ""))
    out = [(f"against {against}, paired by seed", head, body, legend)]
    if group.kind == "training":
        head, body = along_table(group, against, rows)
        if body:
            out.append((f"against {against} along the run: held-out acc. − {against}'s curve at equal tokens", head, body,
                        ALONG_LEGEND.format(row=against)))
    return out


def markdown_table(head: Sequence[str], body: Sequence[Sequence[str]] = ()) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line per row of ``body`` (none:
    the header and rule, for a caller that appends its rows)."""
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in body)]


def render_markdown(groups: Sequence[Group], *, title: str = "trace-gym leaderboard", plots: Sequence[str] = (),
                    notes: Sequence[str] = (), against: str | None = None) -> str:
    """The leaderboard as Markdown: one table per group (with its budget and legend lines, and
    with ``against`` its rows against that row, paired by seed), ``notes``, then links to the plots."""
    out = [f"# {title}", ""]
    for g in groups:
        head, body = _table(g)
        out += [f"## {g.title}", "", _budget_line(g), "", *markdown_table(head, body), "", legend_line(g), ""]
        for sub, head, body, legend in paired_sections(g, against):
            out += [f"### {sub}", "", *markdown_table(head, body), "", legend, ""]
    for note in notes:
        out += [note, ""]
    for p in plots:
        out += [f"![{Path(p).stem}]({p})", ""]
    return "\n".join(out)


def rich_tables(groups: Sequence[Group], width: int | None = None, against: str | None = None):
    """:class:`rich.table.Table` objects for the terminal, one per group (captioned with its
    budget and legend lines), each followed with ``against`` by the group's rows against that
    row, paired by seed. Nothing is cut: with ``width`` (the console's), a group's table
    wider than that is split into narrower ones that each repeat the rank and allocator
    columns; every column folds rather than ending a name with an ellipsis."""
    from trace_gym.cli.tables import fitted_tables

    tables = []
    for g in groups:
        head, body = _table(g)
        tables += fitted_tables(head, body, width or 10**6, keep=2, title=g.title,
                                caption=_budget_line(g) + "\n" + legend_line(g), left=("allocator", "adv."),
                                title_justify="left", caption_justify="left")
        for sub, head, body, legend in paired_sections(g, against):
            tables += fitted_tables(head, body, width or 10**6, keep=1, title=f"{g.title}: {sub}", caption=legend,
                                    left=("allocator", "seeds"), title_justify="left", caption_justify="left")
    return tables


# ----------------------------------------------------------------------------- plots


def _series(row: Row, metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step mean, min and max of ``metric`` over a row's seeds (NaN where undefined)."""
    n = max(len(r.record.steps) for r in row.records)
    vals = np.full((len(row.records), n), np.nan)
    for i, r in enumerate(row.records):
        for s in r.record.steps:
            v = s.metrics.get(metric)
            if v is not None:
                vals[i, s.step] = v
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(vals, 0), np.nanmin(vals, 0), np.nanmax(vals, 0)


def _grid(n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def plot_effective_ratio(groups: Sequence[Group], path: Path) -> Path | None:
    """Effective ratio per step per allocator, one panel per allocation group (band: min-max
    over seeds). Returns the path, or None when there is no allocation group."""
    gs = [g for g in groups if g.kind == "allocation"]
    if not gs:
        return None
    fig, axes = _grid(len(gs))
    from matplotlib.ticker import MaxNLocator

    for ax, g in zip(axes, gs):
        for row in g.rows:
            mean, lo, hi = _series(row, "effective_ratio")
            x = np.arange(1, len(mean) + 1)
            (line,) = ax.plot(x, mean, marker="o" if len(x) <= 12 else None, ms=3, label=row.allocator)
            if len(row.records) > 1:
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(f"{g.env} ({g.policy.get('model') or g.policy.get('name')})", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("effective ratio")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Effective ratio per step (equal budget)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_accuracy(groups: Sequence[Group], path: Path) -> Path | None:
    """Held-out accuracy against trajectories (left) and generated tokens (right) spent, per
    allocator, one row of panels per training group (band: min-max over seeds). Returns the
    path, or None when there is no training group."""
    gs = [g for g in groups if g.kind == "training"]
    if not gs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(gs), 2, figsize=(10.4, 3.8 * len(gs)), squeeze=False)
    for (ax_traj, ax_tok), g in zip(axes, gs):
        lo_all, hi_all = 1.0, 0.0
        for row in g.rows:
            # average the seeds' curves at each evaluation index (evaluations share steps)
            n = min(len(r.record.evals) for r in row.records)
            if n == 0:
                continue
            acc = np.array([[e.accuracy for e in r.record.evals[:n]] for r in row.records])
            lo_all, hi_all = min(lo_all, acc.min()), max(hi_all, acc.max())
            for ax, attr in ((ax_traj, "trajectories"), (ax_tok, "tokens")):
                x = np.mean([[getattr(e, attr) for e in r.record.evals[:n]] for r in row.records], 0)
                (line,) = ax.plot(x, acc.mean(0), marker="o", ms=3, label=row.allocator)
                if len(row.records) > 1:
                    ax.fill_between(x, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
        pad = max(0.02, 0.1 * (hi_all - lo_all))
        for ax, label in ((ax_traj, "trajectories spent"), (ax_tok, "generated tokens spent")):
            ax.set_title(f"{g.env} ({g.policy.get('model') or g.policy.get('name')})", fontsize=10)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out accuracy")
            ax.set_ylim(max(0.0, lo_all - pad), min(1.0, hi_all + pad))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Held-out accuracy against budget spent")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(groups: Sequence[Group], out_dir: Path) -> list[Path]:
    """Write the PNG plots that apply to ``groups`` into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in PLOTS.values():  # a plot of an earlier run in this folder would no longer match
        (out_dir / name).unlink(missing_ok=True)
    made = [plot_effective_ratio(groups, out_dir / PLOTS["effective_ratio"]), plot_accuracy(groups, out_dir / PLOTS["accuracy"])]
    return [p for p in made if p is not None]


# ----------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:2em auto;max-width:1400px;
color:#1d2330;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.15em;margin-top:1.6em}
p.meta{color:#5a6273;font-size:.9em;margin:.2em 0 .8em}
div.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:.88em;margin:.4em 0 1em}
th,td{border:1px solid #d4d8e0;padding:.3em .55em;text-align:right;white-space:nowrap}
th{white-space:normal;vertical-align:bottom}
th{background:#eef1f6} td.alloc{text-align:left;font-weight:600} th:nth-child(2){text-align:left} tr.first td{background:#eaf6ea}
figure{margin:1em 0} figure img{max-width:100%;border:1px solid #e1e4ea}
figcaption{color:#5a6273;font-size:.88em}
"""


def render_html(groups: Sequence[Group], plots: Sequence[Path], *, title: str = "trace-gym leaderboard",
                provenance: str = "", notes: Sequence[str] = (), against: str | None = None) -> str:
    """A static, self-contained HTML page: the tables (with their budget and legend lines, and
    with ``against`` each group's rows against that row, paired by seed), ``notes`` and the
    plots (embedded base64 PNGs)."""
    e = html.escape
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             f"<title>{e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    if provenance:
        parts.append(f"<p class='meta'>{e(provenance)}</p>")
    for g in groups:
        head, body = _table(g)
        parts.append(f"<h2>{e(g.title)}</h2><p class='meta'>{e(_budget_line(g))}</p>")
        legend = f"<p class='meta'>{e(legend_line(g))}</p>"
        parts.append("<div class='scroll'><table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>")
        for r in body:
            cls = " class='first'" if r[0] == "1" else ""  # every row tied for first
            cells = "".join(f"<td class='alloc'>{e(c)}</td>" if i == 1 else f"<td>{e(c)}</td>" for i, c in enumerate(r))
            parts.append(f"<tr{cls}>{cells}</tr>")
        parts.append("</tbody></table></div>")
        parts.append(legend)
        for sub, head, body, paired_legend in paired_sections(g, against):
            parts.append(f"<h3>{e(sub)}</h3><div class='scroll'><table><thead><tr>"
                         + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr></thead><tbody>")
            parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body]
            parts.append(f"</tbody></table></div><p class='meta'>{e(paired_legend)}</p>")
    for note in notes:
        parts.append(f"<p class='meta'>{e(note)}</p>")
    for p in plots:
        data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt='{e(Path(p).stem)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{e(Path(p).name)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_leaderboard(groups: Sequence[Group], out_dir: Path, *, title: str = "trace-gym leaderboard",
                      provenance: str = "", notes: Sequence[str] | None = None, against: str | None = None) -> dict[str, Path]:
    """Write ``leaderboard.md``, ``leaderboard.html`` (with ``notes`` under the tables, and with
    ``against`` each group's rows against that row, paired by seed) and the PNG plots into ``out_dir``."""
    out_dir = Path(out_dir)
    notes = list(notes or [])
    plots = write_plots(groups, out_dir)
    md = out_dir / "leaderboard.md"
    md.write_text(render_markdown(groups, title=title, plots=[p.name for p in plots], notes=notes, against=against))
    page = out_dir / "leaderboard.html"
    page.write_text(render_html(groups, plots, title=title, provenance=provenance, notes=notes, against=against))
    return {"markdown": md, "html": page, **{p.stem: p for p in plots}}


__all__ = ["LEGEND", "METRIC_LABELS", "PLOTS", "evaluation_set_line", "legend_line", "markdown_table", "paired_sections", "plot_accuracy", "plot_effective_ratio", "render_html", "render_markdown",
           "rich_tables", "write_leaderboard", "write_plots"]
