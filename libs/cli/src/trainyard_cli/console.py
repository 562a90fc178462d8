"""The CLI's consoles: what they print is text, never Rich markup.

A message carries text the CLI does not control: a server's error, a spec field, a path, a job's failure
note. Printed through a console that reads markup, ``[bold]x[/bold]`` loses its brackets and
``[/x]`` raises, so the consoles here read none (``markup=False``, ``highlight=False``, also for a table's
plain-string cells); the CLI's own styling is passed as ``style=`` or built as :class:`rich.text.Text`:

    error(f"cannot read {path}")                 # "error: cannot read …" in red, the rest verbatim
    out.print(Text.assemble("submitted ", (job_id, "bold")))

Each console is made at first use (a module-level ``Console()`` would read the terminal at import).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text


@cache
def stdout() -> Console:
    """Tables and results."""
    from rich.console import Console

    return Console(markup=False, highlight=False)


@cache
def stderr() -> Console:
    """Errors, warnings and progress (soft-wrapped: a long path stays one line a terminal wraps)."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def labelled(label: str, style: str, message: str) -> Text:
    """``label: message`` with only the label styled."""
    from rich.text import Text

    return Text.assemble((f"{label}:", style), " ", message)


def error(message: str, console: Console | None = None) -> None:
    """``error: message`` on stderr, the message verbatim."""
    (console or stderr()).print(labelled("error", "red", message))


def warning(message: str, console: Console | None = None) -> None:
    (console or stderr()).print(labelled("warning", "yellow", message))
