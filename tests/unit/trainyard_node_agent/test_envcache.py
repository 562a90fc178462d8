"""What an environment layers over the base, what it still needs, and how an installer's failure is read (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_contract.lockfile import Pin
from trainyard_node_agent.envcache import (
    BaseEnvironment,
    EnvironmentBuildError,
    Installer,
    closure,
    installer_words,
    layer,
    lock_fault,
    unmet_requirements,
)
from trainyard_node_agent.sandbox import RankView, plan_rank

MARKERS = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
           "platform_machine": "x86_64"}
BASE = BaseEnvironment(python="/usr/bin/python3", installed={"torch": "2.13.0", "numpy": "2.4.6",
                                                                "pydantic": "2.14.4", "regex": "2026.11.19"},
                       protected={"torch": "2.13.0", "numpy": "2.4.6", "pydantic": "2.14.4"}, markers=MARKERS)


def test_the_protected_set_is_torch_the_sdk_and_what_they_need_here() -> None:
    requires = {"torch": ["filelock", "typing-extensions>=4", "nvidia-cublas; platform_system == 'Windows'"],
                "trainyard-sdk": ["trainyard-contract", "numpy", "rich; extra == 'cli'"],
                "trainyard-contract": ["pydantic>=2"], "pydantic": ["typing-extensions"], "filelock": [],
                "typing-extensions": [], "numpy": [], "regex": [], "rich": []}
    assert closure(["torch", "trainyard-sdk"], requires, MARKERS) == {
        "torch", "filelock", "typing-extensions", "trainyard-sdk", "trainyard-contract", "pydantic", "numpy"}


def test_a_lock_adds_to_the_base_keeps_its_own_versions_and_never_replaces_them() -> None:
    pins = [Pin("einops", "0.8.1", ("a" * 64,)), Pin("numpy", "2.4.6", ("b" * 64,)),
            Pin("regex", "2024.1.1", ("c" * 64,))]
    assert [p.name for p in layer(pins, BASE, "requirements.txt")] == ["einops", "regex"]  # numpy: the base's
    with pytest.raises(EnvironmentBuildError, match=r"would replace the node's own pydantic==1\.10\.13 \(the node "
                                                    r"has pydantic 2\.14\.4"):
        layer([Pin("pydantic", "1.10.13", ("d" * 64,))], BASE, "requirements.txt")


def test_what_the_installed_packages_need_must_be_there() -> None:
    installed = {"tydep": ("1.0", ["typrobe>=2", "numpy<3", "colorama; sys_platform == 'win32'",
                                   "rich; extra == 'fancy'"]),
                 "typrobe": ("1.0", [])}
    assert unmet_requirements(installed, BASE) == ["tydep 1.0 needs typrobe>=2 (1.0 found)"]
    assert unmet_requirements({"x": ("1", ["missing-dist"])}, BASE) == ["x 1 needs missing-dist (missing)"]


@pytest.mark.parametrize(("output", "job_fault"), [
    ("  × No solution found when resolving dependencies:\n  ╰─▶ Because nonexistent-pkg was not found in the "
     "package registry and you require nonexistent-pkg==1.0, we can conclude that your requirements are "
     "unsatisfiable.", True),
    ("  × Failed to download `typrobe==1.0.0`\n  ╰─▶ Hash mismatch for `typrobe==1.0.0`", True),
    ("  × Failed to build `x==1.0`\n  ╰─▶ Building source distributions is disabled", True),
    ("  × Failed to fetch: `https://pypi.org/simple/einops/`\n  ╰─▶ error sending request: Connection refused", False),
    ("error: No space left on device (os error 28)", False),
])
def test_the_installers_words_say_whose_fault_it_is(output: str, job_fault: bool) -> None:
    assert lock_fault(output) is job_fault
    assert installer_words("Using CPython 3.11.7 interpreter at: /x\n" + output).startswith("×") or not job_fault


def test_the_operator_chooses_the_index_and_nothing_builds_or_links() -> None:
    cmd = Installer("/bin/uv", index_url="https://mirror.example/simple", find_links=("/srv/wheels",)).command(
        Path("/c/req.txt"), Path("/c/tree"), "/usr/bin/python3")
    assert cmd[:3] == ["/bin/uv", "pip", "install"]
    for flag in ("--no-deps", "--require-hashes", "--no-build", "--no-config", "--no-cache"):
        assert flag in cmd
    assert cmd[cmd.index("--link-mode") + 1] == "copy" and cmd[cmd.index("--index-url") + 1].startswith("https://mirror")
    assert cmd[cmd.index("-r") + 1] == "/c/req.txt" and "--no-index" not in cmd


def test_the_environment_is_bound_read_only_into_the_sandbox(tmp_path: Path) -> None:
    cache, env = tmp_path / "env-cache", tmp_path / "env-cache" / ("e" * 64) / "tree"
    view = RankView(attempt_dir=tmp_path / "a", checkpoints=tmp_path / "c", scratch=tmp_path / "a" / "s",
                    code_dir=tmp_path / "code" / "t", env_dir=env)
    plan = plan_rank(view, uid=20000, gid=20000, hidden=[cache, tmp_path / "code"], anchors=[cache])
    (bind,) = [b for b in plan.binds if b.path == str(env)]
    assert not bind.writable and bind.anchor == str(cache)  # opened from the cache down, never through a link
    assert any(env.is_relative_to(c) for c, _ in plan.cover)  # the rest of the cache stays covered
