"""trainyard node agent: heartbeats a node's devices, launches and watches the torch ranks a
GangAllocated assigns to it, relays their event spools, classifies how they end, kills hung
attempts, stops them on revocation, and adopts them again after its own restart.

Pure decisions live in :mod:`admission` (fencing, the rank environment), :mod:`supervision` (a rank's
lifecycle: :class:`RankState`, :func:`transition`), :mod:`classify` (why a rank ended), :mod:`watchdog`
(hang detection) and :mod:`confirmation` (when an announced event was applied). The I/O shells, on an
injected :class:`Clock`, retrying through :mod:`backoff`: :class:`NodeAgent` wires the parts (:mod:`launch`
admits and launches, :mod:`rank_start` starts one rank in its sandbox, :mod:`control` stops or asks ranks
to stop, :mod:`attempts` watches them and closes each attempt's containment, :mod:`rank_table` and
:mod:`recovery` keep and adopt the rank table, :mod:`heartbeat`), one :class:`RankSupervisor` per rank (its
lifecycle, its watch, its exit report) and the :class:`SpoolRelay` (the ranks' spools onto the bus). Ranks start under
:mod:`launcher` (cold) or in a warm interpreter (:mod:`warm`, :class:`WarmPool`), both of which record the rank's exit
status. A job's own code (``spec.code``) runs cold from :class:`CodeCache`, the node's verified, read-only trees (one
per archive hash; :func:`choose_evictions` and :func:`choose_purges` decide what goes, :func:`rank_paths` what a rank of
user code may touch); its liveness counts its output too (:func:`observe`).
"""

from trainyard_node_agent.admission import (
    Launch,
    Refuse,
    interpreter_env,
    judge,
    pick_backend,
    rank_env,
)
from trainyard_node_agent.agent import AgentKeys, NodeAgent, exit_file_for
from trainyard_node_agent.classify import ExitFacts, classify_exit
from trainyard_node_agent.clock import Clock, SystemClock
from trainyard_node_agent.codecache import (
    CacheEntry,
    CodeCache,
    CodeTree,
    Collection,
    Quarantined,
    RankPaths,
    choose_evictions,
    choose_purges,
    rank_paths,
)
from trainyard_node_agent.confirmation import Announcement, verdict
from trainyard_node_agent.localstate import LocalState, merge_tables
from trainyard_node_agent.settings import NodeAgentSettings
from trainyard_node_agent.spool_relay import SpoolRelay
from trainyard_node_agent.supervision import RankState, Trigger, transition
from trainyard_node_agent.supervisor import RankSupervisor
from trainyard_node_agent.warmpool import WarmPool
from trainyard_node_agent.watchdog import (
    Hung,
    Liveness,
    RankProgress,
    find_hangs,
    observe,
)

__all__ = [
    "AgentKeys",
    "Announcement",
    "CacheEntry",
    "Clock",
    "CodeCache",
    "CodeTree",
    "Collection",
    "ExitFacts",
    "Hung",
    "Launch",
    "Liveness",
    "LocalState",
    "NodeAgent",
    "NodeAgentSettings",
    "Quarantined",
    "RankPaths",
    "RankProgress",
    "RankState",
    "RankSupervisor",
    "Refuse",
    "SpoolRelay",
    "SystemClock",
    "Trigger",
    "WarmPool",
    "choose_evictions",
    "choose_purges",
    "classify_exit",
    "exit_file_for",
    "find_hangs",
    "interpreter_env",
    "judge",
    "merge_tables",
    "observe",
    "pick_backend",
    "rank_env",
    "rank_paths",
    "transition",
    "verdict",
]
