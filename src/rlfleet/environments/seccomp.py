"""The sandbox's seccomp filter: no new user namespaces for the untrusted code.

A user namespace gives its creator every capability inside it, and with them kernel surface (mounting
file systems, netfilter, ...) that an unprivileged process otherwise never reaches; the sandboxed code has no
use for one. :func:`user_namespace_filter` builds a classic BPF program, for the machine's own architecture,
that the bootstrap installs (``PR_SET_NO_NEW_PRIVS``, then ``PR_SET_SECCOMP``) just before ``execve``:

* ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` in their flags fail with ``EPERM``;
* ``clone3`` fails with ``ENOSYS`` (its flags sit in memory a filter cannot read): the C library then falls
  back to ``clone``, which the filter can check, as it does under Docker's default profile;
* any system call of another ABI (x32, or 32-bit calls from a 64-bit process) fails with ``EPERM``, so that
  none slips past the numbers checked above;
* everything else is allowed.

It is built here, in the caller, and handed to the stdlib-only bootstrap as bytes (``struct sock_filter``
records, native byte order).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

__all__ = ["CLONE_NEWUSER", "user_namespace_filter"]

CLONE_NEWUSER = 0x10000000

# classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x00 | 0x00 | 0x20
_JMP_JEQ_K = 0x05 | 0x10 | 0x00
_JMP_JGE_K = 0x05 | 0x30 | 0x00
_JMP_JSET_K = 0x05 | 0x40 | 0x00
_RET_K = 0x06 | 0x00
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# offsets in struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # the low 32 bits of args[0] on a little-endian machine
_X32_SYSCALL_BIT = 0x40000000


@dataclass(frozen=True)
class _Abi:
    audit_arch: int
    unshare: int
    clone: int
    clone3: int
    x32_bit: bool  # the architecture has an x32 ABI sharing its audit arch (x86_64)


_ABIS = {
    "x86_64": _Abi(audit_arch=0xC000003E, unshare=272, clone=56, clone3=435, x32_bit=True),
    "aarch64": _Abi(audit_arch=0xC00000B7, unshare=97, clone=220, clone3=435, x32_bit=False),
}


def user_namespace_filter(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (default: this one's, ``platform.machine()``); None where it is not known
    (the sandbox then reports that nested user namespaces are not blocked)."""
    abi = _ABIS.get(machine or platform.machine())
    if abi is None:
        return None
    deny, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    # (label, opcode, true target, false target, k): a target is a label, or None for the next instruction
    program: list[tuple[str | None, int, str | None, str | None, int]] = [
        (None, _LD_W_ABS, None, None, _ARCH),
        (None, _JMP_JEQ_K, None, "deny", abi.audit_arch),
        (None, _LD_W_ABS, None, None, _NR),
    ]
    if abi.x32_bit:
        program.append((None, _JMP_JGE_K, "deny", None, _X32_SYSCALL_BIT))
    program += [
        (None, _JMP_JEQ_K, "flags", None, abi.unshare),
        (None, _JMP_JEQ_K, "flags", None, abi.clone),
        (None, _JMP_JEQ_K, "enosys", None, abi.clone3),
        (None, _RET_K, None, None, _RET_ALLOW),
        ("flags", _LD_W_ABS, None, None, _ARG0_LOW),
        (None, _JMP_JSET_K, "deny", None, CLONE_NEWUSER),
        (None, _RET_K, None, None, _RET_ALLOW),
        ("deny", _RET_K, None, None, deny),
        ("enosys", _RET_K, None, None, enosys),
    ]
    return _assemble(program)


def _assemble(program: list[tuple[str | None, int, str | None, str | None, int]]) -> bytes:
    """``struct sock_filter`` records, jump targets resolved to the offsets after the jumping instruction."""
    at = {label: index for index, (label, *_) in enumerate(program) if label is not None}

    def offset(index: int, target: str | None) -> int:
        return 0 if target is None else at[target] - index - 1

    return b"".join(
        struct.pack("=HBBI", code, offset(index, jt), offset(index, jf), k)
        for index, (_, code, jt, jf, k) in enumerate(program)
    )
