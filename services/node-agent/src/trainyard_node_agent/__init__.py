"""trainyard node agent: heartbeats a node's devices, launches and watches the torch ranks a
GangAllocated assigns to it, relays their event spools and stops them on revocation.

Pure decisions live in :mod:`admission` (fencing, the rank environment); :class:`NodeAgent`
is the I/O shell.
"""

from trainyard_node_agent.admission import Launch, Refuse, judge, pick_backend, rank_env
from trainyard_node_agent.agent import AgentKeys, NodeAgent
from trainyard_node_agent.settings import NodeAgentSettings

__all__ = [
    "AgentKeys",
    "Launch",
    "NodeAgent",
    "NodeAgentSettings",
    "Refuse",
    "judge",
    "pick_backend",
    "rank_env",
]
