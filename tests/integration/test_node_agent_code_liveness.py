"""The hang watchdog and user code that does not use the SDK, with the real node agent, broker and
Redis: a plain script never writes its event spool, so its output is its sign of life. One that
prints keeps running past the hang limit and ends ``ok``; one that printed once and went quiet is
killed as ``hang``. The limits are shortened through the agent's settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from trainyard_contract.storage import ArtifactLayout

from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_code import (  # noqa: F401 - fixtures, used by name
    code_spec,
    layout,
    run_gang,
    store_archive,
)
from tests.integration.test_node_agent_failures import Rig, heartbeat_after, rig  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LIMIT_S = 5  # hang_timeout_s and first_step_timeout_s of the agent under test

# torchrun-style: no SDK, no events; a line every 0.5 s for RUN_FOR_S seconds, then done.
PRINTING = r"""
import os, time
start = time.monotonic()
step = 0
while time.monotonic() - start < float(os.environ["RUN_FOR_S"]):
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.5)
"""
SILENT = r"""
import time
print("loading the model", flush=True)
time.sleep(600)
"""


async def test_a_plain_script_lives_while_it_prints_and_hangs_out_when_it_goes_quiet(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path) -> None:  # noqa: F811 - fixtures
    archive = store_archive(layout, tmp_path / "src", {"printing.py": PRINTING, "silent.py": SILENT})
    rig.services.start("trainyard_node_agent", "agent", **{
        **rig.agent_settings, "hang_timeout_s": LIMIT_S, "first_step_timeout_s": LIMIT_S,
        "code_cache_dir": tmp_path / "cache"})
    await heartbeat_after(rig.tap)

    # prints for twice the limit (never an event): not hung, it ends on its own
    spec = code_spec(1, archive=archive, entrypoint=[sys.executable, "printing.py"],
                     env={"RUN_FOR_S": str(2 * LIMIT_S)})
    _, exits = await run_gang(rig, "prints", spec)
    assert (exits[0].reason, exits[0].exit_code) == ("ok", 0), exits

    # prints once, then neither prints nor reports: hung
    _, exits = await run_gang(rig, "quiet", code_spec(1, archive=archive, entrypoint=[sys.executable, "silent.py"]))
    assert exits[0].reason == "hang", exits
    assert "no first step and no output" in (exits[0].detail or ""), exits
    assert "loading the model" in layout.rank_log("t1", "quiet", 1, 0).read_text()
