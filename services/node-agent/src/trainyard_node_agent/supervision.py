"""A rank's life on this node, as a pure decision: :class:`RankState`, what may happen to it
(:class:`Trigger`), and :func:`transition`, which says the next state and what the agent must do.

::

    NEW ──launched / adopted──▶ RUNNING ──checkpoint requested──▶ CHECKPOINTING
                                   │                                   │
                                   ├──────── the agent stops ──────────┴──▶ STOPPING
                                   ├── revoked, lease lost ──▶ REVOKED          │
                                   ├── no progress ──────────▶ HUNG   ◀────────┤ (either, from STOPPING too)
                                   └── forged event ─────────▶ VIOLATED ◀── from any state but NEW

The state says why the agent ends a rank, which decides how its exit is reported (:func:`exit_causes`):
a rank that was revoked or hung stays so (the first of the two wins), a violation overrides both, and
the agent's own stop only marks a rank nobody else had asked to stop. Whether the process still runs is
an observation, not a state: the agent reads it from the process (or ``/proc``) and passes it in.

A rank already being stopped is not asked to checkpoint: its end is decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RankState(str, Enum):
    NEW = "new"  # a record: its launch is under way (or failed), or restored from the rank table
    RUNNING = "running"  # launched here, or adopted from an earlier agent
    CHECKPOINTING = "checkpointing"  # asked to checkpoint and stop (a CheckpointRequested was delivered)
    STOPPING = "stopping"  # the agent stops it because the agent itself stops
    REVOKED = "revoked"  # the agent stops it: its allocation was revoked, or its device lease is gone
    HUNG = "hung"  # the agent killed it: its attempt made no progress
    VIOLATED = "violated"  # the agent killed it: it claimed what a rank may not (security)


class Trigger(str, Enum):
    LAUNCHED = "launched"
    ADOPTED = "adopted"
    CHECKPOINT_REQUESTED = "checkpoint-requested"
    AGENT_STOPPING = "agent-stopping"
    REVOKED = "revoked"
    HUNG = "hung"
    VIOLATION = "violation"


class Action(str, Enum):
    SIGNAL_CHECKPOINT = "signal-checkpoint"  # SIGUSR1 to its process group (after the request file)
    TERMINATE = "terminate"  # SIGTERM, SIGKILL after the grace
    KILL = "kill"  # SIGKILL its process group at once


@dataclass(frozen=True)
class Step:
    state: RankState
    actions: tuple[Action, ...] = ()


_LIVE = frozenset({RankState.RUNNING, RankState.CHECKPOINTING, RankState.STOPPING})  # nobody ended it yet but us
_ENDED_BY_AGENT = frozenset({RankState.STOPPING, RankState.REVOKED, RankState.HUNG, RankState.VIOLATED})


def transition(state: RankState, trigger: Trigger, *, running: bool) -> Step:
    """The rank's next state after ``trigger``, and the actions on its process (only while it ``running``)."""
    if trigger in (Trigger.LAUNCHED, Trigger.ADOPTED):
        return Step(RankState.RUNNING if state is RankState.NEW else state)
    if trigger is Trigger.CHECKPOINT_REQUESTED:
        if state is RankState.RUNNING and running:
            return Step(RankState.CHECKPOINTING, (Action.SIGNAL_CHECKPOINT,))
        return Step(state)
    if trigger is Trigger.AGENT_STOPPING:  # every rank still running is stopped; the state marks only the unclaimed
        actions = (Action.TERMINATE,) if running and state is not RankState.NEW else ()
        return Step(RankState.STOPPING if state in (RankState.RUNNING, RankState.CHECKPOINTING) else state, actions)
    if trigger is Trigger.REVOKED:
        if state in _LIVE:
            return Step(RankState.REVOKED, (Action.TERMINATE,) if running else ())
        return Step(state)
    if trigger is Trigger.HUNG:
        if state in _LIVE:
            return Step(RankState.HUNG, (Action.KILL,) if running else ())
        return Step(state)
    if state is RankState.NEW or state is RankState.VIOLATED:  # Trigger.VIOLATION
        return Step(state)
    return Step(RankState.VIOLATED, (Action.KILL,) if running else ())


def watched(state: RankState) -> bool:
    """Whether the hang watchdog, the lease check and a drain still look after a running rank in ``state``."""
    return state in _LIVE


def stopped_by_agent(state: RankState) -> bool:
    """Whether the agent ended the rank (so a missing exit status is not ``lost``)."""
    return state in _ENDED_BY_AGENT


@dataclass(frozen=True)
class ExitCauses:
    """The agent's part of an ended rank's :class:`~trainyard_node_agent.classify.ExitFacts`."""

    revoked: str | None = None
    hang: str | None = None
    violation: str | None = None
    stopped_by_agent: bool = False
    fallback_detail: str | None = None  # the detail when the exit itself explains nothing (the agent stopped)


def exit_causes(state: RankState, detail: str | None) -> ExitCauses:
    """What the state (and the reason recorded with it) says about how the rank ended."""
    return ExitCauses(
        revoked=detail if state is RankState.REVOKED else None,
        hang=detail if state is RankState.HUNG else None,
        violation=detail if state is RankState.VIOLATED else None,
        stopped_by_agent=stopped_by_agent(state),
        fallback_detail=detail if state is RankState.STOPPING else None,
    )
