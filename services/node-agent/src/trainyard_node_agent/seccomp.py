"""The rank's seccomp filter: a classic-BPF program refusing (``EPERM``) what a training job never needs and an
escape would: new namespaces (``unshare``, ``clone`` with a ``CLONE_NEW*`` flag, ``setns``), mounts, ``ptrace``
and ``process_vm_readv``/``writev``, kernel modules, ``kexec``, ``bpf``, ``perf_event_open``, the key
retention service, ``reboot``, swap and ``open_by_handle_at``. ``clone3`` answers ``ENOSYS`` (its flags lie
behind a pointer a filter cannot read): glibc then falls back to ``clone``, whose flags are checked — as
Docker's default profile does. A foreign architecture (anything but x86-64 and aarch64) is killed, and so are
x32 system calls on x86-64 (refused, ``EPERM``).

Standard library only: the exec wrapper (:mod:`sandbox`, ``python -I``) installs it after
``PR_SET_NO_NEW_PRIVS``, right before the exec. :func:`program` is pure (its behaviour is tested through a
small BPF interpreter), :func:`install` applies it to the calling thread and its future children.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Mapping, Sequence

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian: arg 0's low word)

CLONE_NEWTIME = 0x00000080  # unshare only (in clone's flags these bits are the exit signal)
NAMESPACE_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC
                   | 0x10000000 | 0x20000000 | 0x40000000)  # NEWUSER, NEWPID, NEWNET

DENIED = ("setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
          "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load",
          "kexec_file_load", "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "init_module",
          "finit_module", "delete_module", "reboot", "swapon", "swapoff", "open_by_handle_at")

SYSCALLS: Mapping[int, Mapping[str, int]] = {
    AUDIT_ARCH_X86_64: {
        "clone": 56, "clone3": 435, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kexec_load": 246,
        "kexec_file_load": 320, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248,
        "request_key": 249, "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
        "swapon": 167, "swapoff": 168, "open_by_handle_at": 304,
    },
    AUDIT_ARCH_AARCH64: {  # asm-generic/unistd.h
        "clone": 220, "clone3": 435, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kexec_load": 104,
        "kexec_file_load": 294, "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217,
        "request_key": 218, "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142,
        "swapon": 224, "swapoff": 225, "open_by_handle_at": 265,
    },
}

Instruction = tuple[int, int, int, int]  # struct sock_filter: code, jt, jf, k
_Item = tuple[int, str | None, str | None, int] | str  # an instruction with label targets, or a label


def _arch_block(arch: int, name: str) -> list[_Item]:
    nr = SYSCALLS[arch]
    deny, enosys, allow = f"{name}.deny", f"{name}.enosys", f"{name}.allow"
    block: list[_Item] = [name, (LD_W_ABS, None, None, OFFSET_NR)]
    if arch == AUDIT_ARCH_X86_64:
        block.append((JGE_K, deny, None, X32_SYSCALL_BIT))
    block += [(JEQ_K, deny, None, nr[call]) for call in DENIED]
    block += [(JEQ_K, enosys, None, nr["clone3"]), (JEQ_K, f"{name}.clone", None, nr["clone"]),
              (JEQ_K, f"{name}.unshare", None, nr["unshare"]), (RET_K, None, None, RET_ALLOW)]
    block += [f"{name}.clone", (LD_W_ABS, None, None, OFFSET_ARG0), (JSET_K, deny, allow, NAMESPACE_FLAGS)]
    block += [f"{name}.unshare", (LD_W_ABS, None, None, OFFSET_ARG0),
              (JSET_K, deny, allow, NAMESPACE_FLAGS | CLONE_NEWTIME)]
    block += [deny, (RET_K, None, None, RET_ERRNO | errno.EPERM), enosys, (RET_K, None, None, RET_ERRNO | errno.ENOSYS),
              allow, (RET_K, None, None, RET_ALLOW)]
    return block


def assemble(items: Sequence[_Item]) -> list[Instruction]:
    """Resolve label targets into the relative jumps of classic BPF (forward only, at most 255)."""
    labels: dict[str, int] = {}
    for item in items:
        if isinstance(item, str):
            labels[item] = sum(1 for i in items[: items.index(item)] if not isinstance(i, str))
    out: list[Instruction] = []
    for item in items:
        if isinstance(item, str):
            continue
        code, jt, jf, k = item
        here = len(out)
        offsets = [0 if t is None else labels[t] - here - 1 for t in (jt, jf)]
        if not all(0 <= o <= 255 for o in offsets):
            raise ValueError(f"jump out of range at instruction {here}")
        out.append((code, offsets[0], offsets[1], k))
    return out


def program() -> list[Instruction]:
    """The filter, as ``struct sock_filter`` tuples. Pure."""
    items: list[_Item] = [(LD_W_ABS, None, None, OFFSET_ARCH),
                          (JEQ_K, "x86_64", None, AUDIT_ARCH_X86_64),
                          (JEQ_K, "aarch64", None, AUDIT_ARCH_AARCH64),
                          (RET_K, None, None, RET_KILL_PROCESS)]
    items += _arch_block(AUDIT_ARCH_X86_64, "x86_64") + _arch_block(AUDIT_ARCH_AARCH64, "aarch64")
    return assemble(items)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def install(instructions: Sequence[Instruction] | None = None) -> None:
    """Install the filter on the calling thread (inherited across fork and exec); needs no-new-privs first."""
    code = list(program() if instructions is None else instructions)
    array = (_SockFilter * len(code))(*(_SockFilter(*i) for i in code))
    prog = _SockFprog(len(code), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(err, err)}")
