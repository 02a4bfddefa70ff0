"""Tables that never cut a name: a table wider than the terminal is split into several
narrower ones that each repeat the key column(s) (the row names), and every cell folds
rather than ending in an ellipsis when a single column is still too wide.

Used by ``trace-gym bench`` and the leaderboard's terminal tables.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["column_chunks", "fitted_tables"]


def _natural(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]


def column_chunks(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, keep: int = 1) -> list[list[int]]:
    """Column indices of each table when a table of ``headers`` x ``rows`` is split to fit
    ``width`` characters: every chunk starts with the first ``keep`` columns, then as many of
    the others, in order, as fit at their natural width (one per chunk at least). A table
    that fits is one chunk with every column."""
    natural = _natural(headers, rows)
    cost = lambda i: natural[i] + 3  # noqa: E731  (a cell's padding and its border)
    base = 1 + sum(cost(i) for i in range(keep))
    chunks: list[list[int]] = []
    current: list[int] = []
    used = base
    for i in range(keep, len(headers)):
        if current and used + cost(i) > width:
            chunks.append(current)
            current, used = [], base
        current.append(i)
        used += cost(i)
    if current or not chunks:
        chunks.append(current)
    return [list(range(keep)) + chunk for chunk in chunks]


def fitted_tables(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, *, title: str = "",
                  caption: str = "", keep: int = 1, left: Sequence[str] = (), **table_kwargs: Any) -> list[Any]:
    """:class:`rich.table.Table` objects that show ``rows`` within ``width`` characters
    (:func:`column_chunks`): the title on the first, the caption on the last; columns named
    in ``left`` are left-aligned, the others right-aligned; every column folds. Cells are
    plain text (markup is escaped). The tables after the first are titled "(continued, i/n)"."""
    from rich.markup import escape
    from rich.table import Table

    chunks = column_chunks(headers, rows, width, keep)
    tables = []
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        if len(chunks) == 1:
            name = title
        else:
            name = f"{title} (1/{len(chunks)})" if n == 0 else f"(continued, {n + 1}/{len(chunks)})"
        t = Table(title=escape(name) if name else None, caption=escape(caption) if caption and last else None,
                  **table_kwargs)
        for i in chunk:
            t.add_column(escape(headers[i]), justify="left" if headers[i] in left else "right", overflow="fold",
                         no_wrap=False)
        for r in rows:
            t.add_row(*(escape(r[i]) for i in chunk))
        tables.append(t)
    return tables
