"""`jobs get` shows goodput, checkpoint advice and stragglers; `admin nodes list` a node table."""

from __future__ import annotations

import io

from rich.console import Console

from trainyard_cli.client import Job
from trainyard_cli.render import fmt_advice, fmt_goodput, job_detail, nodes_table


def rendered(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]  # a test double's attribute


def test_goodput_and_advice_lines() -> None:
    goodput = {"allocatedDeviceSeconds": 1000.0, "goodput": 0.62,
               "wasted": {"lostWork": 40.0, "launchRestore": 12.4, "hang": 0.0}}
    assert fmt_goodput(goodput) == "62% of 1000 device-s productive; wasted: lostWork 40, launchRestore 12"
    assert fmt_advice({"intervalSteps": 37, "method": "daly", "currentIntervalSteps": 20}) == \
        "every 37 steps (daly; now 20)"
    assert fmt_advice({"intervalSteps": None, "auto": True}) == "no advice yet (-) auto"


def test_job_detail_shows_them_and_the_queued_reason_kind() -> None:
    job = Job.model_validate({
        "jobId": "job-1", "state": "queued", "specHash": "h", "queuedReason": "no capacity",
        "queuedReasonKind": "capacity", "goodput": {"allocatedDeviceSeconds": 10.0, "goodput": 0.5, "wasted": {}},
        "checkpointAdvice": {"intervalSteps": 37, "method": "young"},
        "stragglers": [{"attempt": 2, "rank": 1, "nodeId": "node-b", "slowdown": 2.5}],
    })
    text = rendered(job_detail(job))
    assert "no capacity (capacity)" in text and "50% of 10 device-s productive" in text
    assert "every 37 steps (young)" in text and "rank 1 on node-b: 2.50x" in text


def test_nodes_table() -> None:
    text = rendered(nodes_table([
        {"nodeId": "node-a", "host": "h", "devices": [{}, {}], "healthy": True, "quarantined": True,
         "quarantine": {"reason": "3 failures", "by": "reputation"}, "reputationScore": 3.25},
        {"nodeId": "node-b", "host": "h2", "devices": [], "healthy": False, "quarantined": False},
        {"nodeId": "node-c", "host": "h3", "devices": [], "healthy": True, "quarantined": False, "drained": True,
         "drain": {"reason": "kernel upgrade", "by": "olga"}},
    ]))
    assert "3 failures (by reputation)" in text and "3.25" in text and "node-b" in text
    assert "kernel upgrade (by olga)" in text
