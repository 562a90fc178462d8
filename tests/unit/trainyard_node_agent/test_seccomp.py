"""The rank's seccomp filter: its classic-BPF program run through a small interpreter (what the kernel
would answer for a system call on each architecture), and, as root, installed for real in a child."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys

import pytest
from trainyard_node_agent import seccomp as sc

X86, ARM = sc.AUDIT_ARCH_X86_64, sc.AUDIT_ARCH_AARCH64
EPERM, ENOSYS = sc.RET_ERRNO | errno.EPERM, sc.RET_ERRNO | errno.ENOSYS
CLONE_THREAD_FLAGS = 0x3D0F00  # VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID
SIGCHLD = 17


def run(program: list[sc.Instruction], nr: int, arch: int = X86, *args: int) -> int:
    """What ``program`` returns for one system call (struct seccomp_data, little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == sc.LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == sc.RET_K:
            return k
        else:
            taken = {sc.JEQ_K: acc == k, sc.JGE_K: acc >= k, sc.JSET_K: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


PROGRAM = sc.program()


@pytest.mark.parametrize("arch", [X86, ARM])
@pytest.mark.parametrize("call", sc.DENIED)
def test_each_denied_call_is_refused_with_eperm(arch: int, call: str) -> None:
    assert run(PROGRAM, sc.SYSCALLS[arch][call], arch) == EPERM


@pytest.mark.parametrize("arch", [X86, ARM])
@pytest.mark.parametrize(("call", "flags", "answer"), [
    ("clone", CLONE_THREAD_FLAGS, sc.RET_ALLOW),  # a thread
    ("clone", SIGCHLD, sc.RET_ALLOW),  # fork
    ("clone", SIGCHLD | 0x10000000, EPERM),  # CLONE_NEWUSER
    ("clone", SIGCHLD | 0x20000000, EPERM),  # CLONE_NEWPID
    ("clone", SIGCHLD | 0x40000000, EPERM),  # CLONE_NEWNET
    ("clone", SIGCHLD | 0x00020000, EPERM),  # CLONE_NEWNS
    ("clone3", 0, ENOSYS),  # flags behind a pointer: glibc falls back to clone
    ("unshare", 0x10000000, EPERM),
    ("unshare", 0x00020000, EPERM),
    ("unshare", 0x00000080, EPERM),  # CLONE_NEWTIME
    ("unshare", 0x00000400, sc.RET_ALLOW),  # CLONE_FILES: no namespace
])
def test_namespaces_cannot_be_made_but_threads_and_forks_can(arch: int, call: str, flags: int, answer: int) -> None:
    assert run(PROGRAM, sc.SYSCALLS[arch][call], arch, flags) == answer


@pytest.mark.parametrize(("arch", "nr"), [(X86, 0), (X86, 1), (X86, 59), (ARM, 63), (ARM, 221)])
def test_ordinary_calls_are_allowed(arch: int, nr: int) -> None:  # read, write, execve; read, execve
    assert run(PROGRAM, nr, arch) == sc.RET_ALLOW


def test_x32_calls_and_foreign_architectures_are_refused() -> None:
    assert run(PROGRAM, sc.X32_SYSCALL_BIT | 1, X86) == EPERM
    assert run(PROGRAM, 0, 0x40000003) == sc.RET_KILL_PROCESS  # i386
    assert run(PROGRAM, 0, 0x40000028) == sc.RET_KILL_PROCESS  # arm (32-bit)


def test_the_two_tables_name_the_same_calls() -> None:
    assert set(sc.SYSCALLS[X86]) == set(sc.SYSCALLS[ARM]) == {*sc.DENIED, "clone", "clone3", "unshare"}
    assert len(PROGRAM) < 4096  # BPF_MAXINSNS


def test_a_jump_too_far_is_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        sc.assemble([(sc.JEQ_K, "far", None, 1), *[(sc.RET_K, None, None, 0)] * 300, "far", (sc.RET_K, None, None, 0)])


CHILD = r"""
import ctypes, json, os, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
import seccomp
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
seccomp.install()
def errno_of(result): return 0 if result == 0 else ctypes.get_errno()
seen = {"unshare_user": errno_of(libc.unshare(0x10000000)),
        "mount": errno_of(libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)),
        "ptrace": errno_of(libc.ptrace(16, os.getppid(), None, None))}
t = threading.Thread(target=lambda: seen.__setitem__("thread", 0)); t.start(); t.join()
seen["subprocess"] = subprocess.run(["true"]).returncode
print(json.dumps(seen))
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="the filter is built for Linux on x86-64 and aarch64 only")
def test_installed_for_real_threads_and_subprocesses_run_namespaces_mounts_and_ptrace_do_not() -> None:
    done = subprocess.run([sys.executable, "-I", "-c", CHILD, os.path.dirname(sc.__file__)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"unshare_user": errno.EPERM, "mount": errno.EPERM, "ptrace": errno.EPERM,
                                       "thread": 0, "subprocess": 0}
