"""A rank's lifecycle on the node: the transition table, and what each state says about the exit."""

from __future__ import annotations

import pytest

from trainyard_node_agent.supervision import (
    Action,
    ExitCauses,
    RankState,
    Step,
    Trigger,
    exit_causes,
    transition,
    watched,
)

S, T, A = RankState, Trigger, Action
CKPT, TERM, KILL = A.SIGNAL_CHECKPOINT, A.TERMINATE, A.KILL

# (state, trigger, running) -> (next state, actions)
TABLE = [
    # start: launched here, or adopted from an earlier agent
    (S.NEW, T.LAUNCHED, True, S.RUNNING, ()),
    (S.NEW, T.ADOPTED, True, S.RUNNING, ()),
    (S.RUNNING, T.LAUNCHED, True, S.RUNNING, ()),
    # a restored record that no longer runs is only reported: nobody stops it, nobody asks it anything
    (S.NEW, T.REVOKED, False, S.NEW, ()),
    (S.NEW, T.HUNG, False, S.NEW, ()),
    (S.NEW, T.VIOLATION, False, S.NEW, ()),
    (S.NEW, T.AGENT_STOPPING, False, S.NEW, ()),
    (S.NEW, T.CHECKPOINT_REQUESTED, False, S.NEW, ()),
    # checkpoint and stop: once, and only while it runs
    (S.RUNNING, T.CHECKPOINT_REQUESTED, True, S.CHECKPOINTING, (CKPT,)),
    (S.RUNNING, T.CHECKPOINT_REQUESTED, False, S.RUNNING, ()),
    (S.CHECKPOINTING, T.CHECKPOINT_REQUESTED, True, S.CHECKPOINTING, ()),  # a duplicate
    (S.STOPPING, T.CHECKPOINT_REQUESTED, True, S.STOPPING, ()),
    (S.REVOKED, T.CHECKPOINT_REQUESTED, True, S.REVOKED, ()),
    (S.HUNG, T.CHECKPOINT_REQUESTED, True, S.HUNG, ()),
    (S.VIOLATED, T.CHECKPOINT_REQUESTED, True, S.VIOLATED, ()),
    # the agent stops: every rank still running is stopped; only the unclaimed ones are marked STOPPING
    (S.RUNNING, T.AGENT_STOPPING, True, S.STOPPING, (TERM,)),
    (S.CHECKPOINTING, T.AGENT_STOPPING, True, S.STOPPING, (TERM,)),
    (S.REVOKED, T.AGENT_STOPPING, True, S.REVOKED, (TERM,)),
    (S.HUNG, T.AGENT_STOPPING, True, S.HUNG, (TERM,)),
    (S.VIOLATED, T.AGENT_STOPPING, True, S.VIOLATED, (TERM,)),
    (S.RUNNING, T.AGENT_STOPPING, False, S.STOPPING, ()),
    # revoked (or its lease lost): marked even after it exited (its exit is then reported as revoked)
    (S.RUNNING, T.REVOKED, True, S.REVOKED, (TERM,)),
    (S.RUNNING, T.REVOKED, False, S.REVOKED, ()),
    (S.CHECKPOINTING, T.REVOKED, True, S.REVOKED, (TERM,)),
    (S.STOPPING, T.REVOKED, True, S.REVOKED, (TERM,)),
    (S.REVOKED, T.REVOKED, True, S.REVOKED, ()),  # the first revocation wins
    (S.HUNG, T.REVOKED, True, S.HUNG, ()),  # a hung rank stays hung
    (S.VIOLATED, T.REVOKED, True, S.VIOLATED, ()),
    # hung: killed at once
    (S.RUNNING, T.HUNG, True, S.HUNG, (KILL,)),
    (S.CHECKPOINTING, T.HUNG, True, S.HUNG, (KILL,)),
    (S.STOPPING, T.HUNG, True, S.HUNG, (KILL,)),
    (S.REVOKED, T.HUNG, True, S.REVOKED, ()),
    (S.HUNG, T.HUNG, True, S.HUNG, ()),
    (S.VIOLATED, T.HUNG, True, S.VIOLATED, ()),
    # a forged event overrides every other reason, killed at once
    (S.RUNNING, T.VIOLATION, True, S.VIOLATED, (KILL,)),
    (S.CHECKPOINTING, T.VIOLATION, True, S.VIOLATED, (KILL,)),
    (S.STOPPING, T.VIOLATION, True, S.VIOLATED, (KILL,)),
    (S.REVOKED, T.VIOLATION, True, S.VIOLATED, (KILL,)),
    (S.HUNG, T.VIOLATION, False, S.VIOLATED, ()),
    (S.VIOLATED, T.VIOLATION, True, S.VIOLATED, ()),
]


@pytest.mark.parametrize(("state", "trigger", "running", "after", "actions"), TABLE,
                         ids=[f"{s.value}-{t.value}-{'running' if r else 'ended'}" for s, t, r, _, _ in TABLE])
def test_transition(state: RankState, trigger: Trigger, running: bool, after: RankState,
                    actions: tuple[Action, ...]) -> None:
    assert transition(state, trigger, running=running) == Step(after, actions)


def test_every_state_and_trigger_has_an_answer() -> None:
    for state in RankState:
        for trigger in Trigger:
            for running in (True, False):
                step = transition(state, trigger, running=running)
                assert isinstance(step.state, RankState)
                assert running or not step.actions, "nothing is signalled once the process is gone"


@pytest.mark.parametrize(("state", "looked_after"), [
    (S.NEW, False), (S.RUNNING, True), (S.CHECKPOINTING, True), (S.STOPPING, True),
    (S.REVOKED, False), (S.HUNG, False), (S.VIOLATED, False),
])
def test_which_states_the_watchdog_and_the_lease_check_look_after(state: RankState, looked_after: bool) -> None:
    assert watched(state) is looked_after


@pytest.mark.parametrize(("state", "causes"), [
    (S.NEW, ExitCauses()),
    (S.RUNNING, ExitCauses()),
    (S.CHECKPOINTING, ExitCauses()),
    (S.STOPPING, ExitCauses(stopped_by_agent=True, fallback_detail="why")),
    (S.REVOKED, ExitCauses(revoked="why", stopped_by_agent=True)),
    (S.HUNG, ExitCauses(hang="why", stopped_by_agent=True)),
    (S.VIOLATED, ExitCauses(violation="why", stopped_by_agent=True)),
])
def test_what_the_state_says_about_the_exit(state: RankState, causes: ExitCauses) -> None:
    assert exit_causes(state, "why") == causes
