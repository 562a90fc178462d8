"""Tables that fit the width they are printed at (80 columns without a terminal).

A rich table wider than the console shrinks every wrappable column in proportion: at 80 columns the jobs
table squeezed 7 of its 11 columns to nothing, the failure note among them, and a manifest path folded
letter by letter over 13 lines. A :class:`Fitted` table decides, when it is rendered and so at the width it
gets, which columns to show and how wide each is. Each column says how it gives way:

- ``fixed``: ids, states, numbers, times. Shown whole or not at all.
- ``wrap``: notes and reasons. Wrapped at words, never narrower than ``min_width``.
- ``middle``: paths, URIs, names. One line, shortened in the middle (``file:///wo…/step-40/manifest.json``),
  never narrower than ``min_width``.

and how much it matters (``keep``): while the columns' least widths do not fit, the column with the lowest
``keep`` is left out. Width left over goes to the ``wrap`` and ``middle`` columns, the narrowest first, up to
what their cells need. A caption names the columns left out and says when cells were shortened
(``--json`` prints everything). :func:`fit` is the decision, pure; :class:`Fitted` renders it.

    table = Fitted("training jobs", [Col("JOB", keep=100), Col("NOTE", "wrap", keep=90, min_width=24)])
    table.add_row(job_id, note)
    console.print(table)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rich.cells import cell_len
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

Fit = Literal["fixed", "wrap", "middle"]
GAP = 2
"""Spaces between two columns (no vertical rules: a rule costs a column's worth at 80)."""
ELLIPSIS = "…"


@dataclass(frozen=True)
class Col:
    """One column: its header, how it gives way (module docstring), and how much it matters."""

    header: str
    fit: Fit = "fixed"
    keep: int = 50
    min_width: int = 12
    justify: Literal["left", "right"] = "left"


def natural_width(header: str, cells: Iterable[str]) -> int:
    """The width a column needs to show its header and every cell on one line."""
    return max([cell_len(header), *(cell_len(c) for c in cells)])


def least_width(col: Col, natural: int) -> int:
    return natural if col.fit == "fixed" else min(natural, max(col.min_width, cell_len(col.header)))


def fit(cols: Sequence[Col], natural: Sequence[int], width: int) -> list[int | None]:
    """Each column's width at ``width`` (gaps included), ``None`` for a column left out.

    Columns are left out lowest ``keep`` first until the least widths fit; the first column is never left
    out (a table of nothing says less than a table too wide).
    """
    shown = list(range(len(cols)))
    least = [least_width(c, n) for c, n in zip(cols, natural, strict=True)]

    def needed() -> int:
        return sum(least[i] for i in shown) + GAP * max(len(shown) - 1, 0)

    while needed() > width and len(shown) > 1:
        shown.remove(min(shown[1:], key=lambda i: (cols[i].keep, -i)))
    widths: list[int | None] = [least[i] if i in shown else None for i in range(len(cols))]
    spare = width - needed()
    flexible = [i for i in shown if cols[i].fit != "fixed"]
    while spare > 0:
        growing = [i for i in flexible if (widths[i] or 0) < natural[i]]
        if not growing:
            break
        narrowest = min(growing, key=lambda i: widths[i] or 0)
        widths[narrowest] = (widths[narrowest] or 0) + 1
        spare -= 1
    if len(shown) == 1 and spare < 0:  # one column wider than the console: it gives way, whatever its kind
        only = shown[0]
        widths[only] = max(width, 1)
    return widths


def shorten_middle(text: str, width: int) -> str:
    """``text`` in ``width`` cells: its start, ``…``, and its end (the end of a path says most)."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    head = max((width - 1) // 3, 1)
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def as_text(cell: str | Text) -> Text:
    """A cell as text: a string is shown as it is, brackets and all (never read as markup)."""
    return cell.copy() if isinstance(cell, Text) else Text(cell)


class Fitted:
    """A table laid out by :func:`fit` at the width it is rendered at (a rich renderable)."""

    def __init__(self, title: str | None, cols: Sequence[Col], *, caption: str | None = None,
                 hint: str = "--json shows everything") -> None:
        self.title = title
        self.cols = list(cols)
        self.caption = caption
        self.hint = hint
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str | Text) -> None:
        if len(cells) != len(self.cols):
            raise ValueError(f"{len(cells)} cells for {len(self.cols)} columns")
        self.rows.append([as_text(c) for c in cells])

    def layout(self, width: int) -> list[int | None]:
        natural = [natural_width(c.header, (row[i].plain for row in self.rows)) for i, c in enumerate(self.cols)]
        return fit(self.cols, natural, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.table import Table

        widths = self.layout(options.max_width)
        shown = [i for i, w in enumerate(widths) if w is not None]
        shortened = False
        table = Table(title=self.title, title_justify="left", header_style="bold", box=None, padding=(0, GAP // 2),
                      pad_edge=False, collapse_padding=False, show_edge=False)
        for i in shown:
            col = self.cols[i]
            table.add_column(col.header, width=widths[i], justify=col.justify, no_wrap=col.fit != "wrap",
                             overflow="fold" if col.fit == "wrap" else "ellipsis")
        for row in self.rows:
            cells = []
            for i in shown:
                cell, width = row[i], widths[i] or 0
                if self.cols[i].fit == "middle" and cell_len(cell.plain) > width:
                    cell = Text(shorten_middle(cell.plain, width), style=cell.style)
                    shortened = True
                cells.append(cell)
            table.add_row(*cells)
        notes = [self.caption] if self.caption else []
        hidden = [self.cols[i].header for i, w in enumerate(widths) if w is None]
        if hidden or shortened:
            what = [f"not shown: {', '.join(hidden)}"] if hidden else []
            what += [f"{ELLIPSIS} marks a value cut short"] if shortened else []
            notes.append(f"{'; '.join(what)} (at {options.max_width} columns; {self.hint})")
        if notes:
            table.caption = Text("\n".join(notes), style="dim")
            table.caption_justify = "left"
        yield table
