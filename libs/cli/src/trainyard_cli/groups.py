"""Command groups imported when they are used, so ``trainyard jobs list`` does not pay for ``trainyard plan``.

typer turns the whole command tree into click commands before it parses a word, so every group's module,
and what it imports at its top, is imported by every command: ``plan``'s options are typed by the
planner's enums (the planner and the platform's pydantic models), ``dev`` imports the stack (redis,
opentelemetry, pydantic-settings), ``models`` the storage code. :class:`LazyGroup` names such groups by
where they live and imports one only when a command line reaches it; ``trainyard --help`` lists them with
the one line of help given here (``test_lazy_groups_help_matches_their_apps`` keeps it equal to the
group's own).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import typer
from typer.core import TyperGroup


@dataclass(frozen=True)
class Lazy:
    """A group at ``module:attribute`` (a ``typer.Typer``), with the help ``trainyard --help`` shows for it."""

    target: str
    help: str

    def app(self) -> typer.Typer:
        module, _, attribute = self.target.partition(":")
        found: typer.Typer = getattr(importlib.import_module(module), attribute)
        return found


class LazyGroup(TyperGroup):
    """A typer group whose ``lazy`` subgroups are imported on first use (subclass it and fill ``lazy``)."""

    lazy: ClassVar[dict[str, Lazy]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]  # click's Context, typer's subclass
        return [*super().list_commands(ctx), *(name for name in self.lazy if name not in self.commands)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:  # type: ignore[override]  # as above
        if cmd_name in self.commands or cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        entry = self.lazy[cmd_name]
        if self._listing:  # this group's --help: a name and a line are all it shows
            return TyperGroup(name=cmd_name, help=entry.help)
        command = typer.main.get_group(entry.app())  # as add_typer would (no completion options)
        command.name = cmd_name
        self.commands[cmd_name] = command
        return command

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:  # type: ignore[override]  # as above
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False
