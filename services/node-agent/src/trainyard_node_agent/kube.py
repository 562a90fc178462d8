"""A Kubernetes node drain is a trainyard drain.

``kubectl drain`` (and ``kubectl cordon``, a cluster autoscaler's scale-down, a node upgrade) marks the
Node unschedulable first and then evicts its pods, but leaves DaemonSet pods alone: the node agent
is never sent SIGTERM. So the agent watches its own Node object (``TRAINYARD_KUBE_NODE_NAME``, the
downward API's ``spec.nodeName``) and turns the cordon into a drain: a ``NodeDrained`` by
``kubernetes`` (nothing new is placed there; the attempts running there checkpoint at an agreed step
and stop, interrupted by maintenance), and ``NodeUndrained`` once the node is schedulable again.

Level-triggered: every poll compares the Node with the scheduler's drain record, so a lost event, a
restarted agent (whose new incarnation ends the old drain) or a restarted scheduler converge on the
next poll. An admin's drain is never undone by an uncordon.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import httpx

from trainyard_contract.errors import InfrastructureError

log = logging.getLogger(__name__)

#: ``by`` of the drains this watch starts (and the only ones it ends).
KUBERNETES = "kubernetes"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
Action = Literal["drain", "undrain"]
#: An action published and not yet in the scheduler's drain record is not published again for this
#: long: the scheduler may be busy, and a poll every fraction of a second would repeat it on the bus.
RESEND_S = 10.0


def is_cordoned(node: Mapping[str, Any]) -> bool:
    """Whether a Node object (the API's JSON) is marked unschedulable (cordoned, being drained)."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return True
    return any(t.get("key") == UNSCHEDULABLE_TAINT for t in spec.get("taints") or [])


def cordon_action(cordoned: bool, drain: Mapping[str, Any] | None) -> Action | None:
    """What to publish, given the Node's state and the scheduler's drain record of it (None: not drained)."""
    if cordoned:
        return "drain" if drain is None else None
    if drain is not None and drain.get("by") == KUBERNETES:
        return "undrain"
    return None


def due(action: Action | None, sent: tuple[Action, float] | None, now: float,
        resend_s: float = RESEND_S) -> bool:
    """Whether to publish ``action`` now, given the last one published (and when) that the drain record
    does not show yet: the same action is repeated only after ``resend_s`` (a lost event converges)."""
    if action is None:
        return False
    return sent is None or sent[0] != action or now - sent[1] >= resend_s


class KubeNodeWatch:
    """Reads this node's Node object from the Kubernetes API with the pod's service-account token."""

    def __init__(self, api_url: str, node_name: str, *, token_file: Path, ca_file: Path | None,
                 timeout_s: float = 5.0) -> None:
        self.node_name = node_name
        self.url = f"{api_url.rstrip('/')}/api/v1/nodes/{node_name}"
        self.token_file = token_file
        verify: bool | str = str(ca_file) if ca_file and ca_file.exists() else True
        self._client = httpx.AsyncClient(timeout=timeout_s, verify=verify)

    async def cordoned(self) -> bool:
        """Whether the node is cordoned now; InfrastructureError (retryable) when the API cannot tell."""
        headers = {"Accept": "application/json"}
        if self.token_file.exists():  # re-read: projected tokens rotate
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        try:
            resp = await self._client.get(self.url, headers=headers)
        except httpx.HTTPError as exc:
            raise InfrastructureError(f"Kubernetes API unreachable at {self.url}: {exc!r}") from exc
        if resp.status_code != 200:
            hint = " (does the agent's service account may 'get' nodes?)" if resp.status_code in (401, 403) else ""
            raise InfrastructureError(f"Kubernetes API answered {resp.status_code} for node {self.node_name}{hint}: "
                                      f"{resp.text[:200]}")
        try:
            return is_cordoned(resp.json())
        except (ValueError, json.JSONDecodeError) as exc:
            raise InfrastructureError(f"Kubernetes API sent no Node JSON for {self.node_name}: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.aclose()
