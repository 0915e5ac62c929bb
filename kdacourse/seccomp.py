"""Seccomp filters in classic BPF, written from Python with the standard library only (Linux, x86-64
and AArch64).

A filter is a list of rules, each `Rule(syscall, errno, ...)`: that system call fails with that errno,
always or when an argument has some of a mask's bits (`any_bits`) or differs from a value
(`not_equal`); every other call is allowed. `program(rules)` compiles them to the bytes of a
`struct sock_filter` array for the machine this runs on, `install(program)` applies them to the
calling thread (and so to everything it executes after: a filter is inherited and cannot be lifted),
after setting no_new_privs, which an unprivileged process needs for it.

The file imports nothing but the standard library, so that a launcher run with `python -I -S` can
load it by path (kdacourse/sandbox_launcher.py). Run as a script, it applies a filter to a command:

    python -I -S seccomp.py PROGRAM_HEX [--drop-capability N ...] -- COMMAND...

(the capabilities dropped from the bounding set first, so that the command, run as root, lacks them).
"""

import ctypes
import errno as errnos
import os
import platform
import struct
import sys
from dataclasses import dataclass

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# BPF opcodes: load a word of seccomp_data, jump on equal / on any bit set / on greater or equal, return
LOAD_WORD, JUMP_EQUAL, JUMP_ANY_BIT, JUMP_AT_LEAST, RETURN = 0x20, 0x15, 0x45, 0x35, 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR_OFFSET, ARCH_OFFSET, ARGS_OFFSET = 0, 4, 16
X32_SYSCALL_BIT = 0x40000000  # x86-64's x32 ABI: the same calls under other numbers, refused here

# The architecture's audit id and the numbers of the system calls the course's filters name.
ARCHITECTURES = {
    "x86_64": (0xC000003E, {"clone": 56, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
                            "pivot_root": 155, "clone3": 435, "socket": 41, "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, {"clone": 220, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
                             "pivot_root": 41, "clone3": 435, "socket": 198, "io_uring_setup": 425}),
}


class SeccompUnavailable(Exception):
    """No filter can be compiled or applied here (the message says why)."""


@dataclass(frozen=True)
class Rule:
    """`syscall` fails with `errno`: always, or when argument `argument`'s low 32 bits have any bit
    of `any_bits`, or differ from `not_equal`."""

    syscall: str
    errno: int
    argument: int = 0
    any_bits: int | None = None
    not_equal: int | None = None


def architecture():
    """(audit id, {syscall: number}) of this machine; SeccompUnavailable elsewhere."""
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in ARCHITECTURES:
        raise SeccompUnavailable(f"seccomp filters are written here for Linux on {', '.join(ARCHITECTURES)}, "
                                 f"not {sys.platform} on {machine}")
    return ARCHITECTURES[machine]


def _instruction(code, jump_true, jump_false, value):
    return struct.pack("=HBBI", code, jump_true, jump_false, value)


def program(rules):
    """The filter's `struct sock_filter` array as bytes: a call of another architecture fails with
    ENOSYS; each rule's call, when its condition holds, with its errno; every other call runs."""
    arch, numbers = architecture()
    refused = SECCOMP_RET_ERRNO | errnos.ENOSYS
    code = [_instruction(LOAD_WORD, 0, 0, ARCH_OFFSET),
            _instruction(JUMP_EQUAL, 1, 0, arch),
            _instruction(RETURN, 0, 0, refused),
            _instruction(LOAD_WORD, 0, 0, NR_OFFSET)]
    if platform.machine() == "x86_64":
        code += [_instruction(JUMP_AT_LEAST, 0, 1, X32_SYSCALL_BIT), _instruction(RETURN, 0, 0, refused)]
    for rule in rules:
        fail = _instruction(RETURN, 0, 0, SECCOMP_RET_ERRNO | rule.errno)
        number = numbers[rule.syscall]
        if rule.any_bits is None and rule.not_equal is None:
            code += [_instruction(JUMP_EQUAL, 0, 1, number), fail]
            continue
        # the call's number, else skip the 4 instructions below; the argument; the test; fail; the
        # number back in the accumulator for the next rule
        test = (_instruction(JUMP_ANY_BIT, 0, 1, rule.any_bits) if rule.any_bits is not None
                else _instruction(JUMP_EQUAL, 1, 0, rule.not_equal))
        code += [_instruction(JUMP_EQUAL, 0, 4, number),
                 _instruction(LOAD_WORD, 0, 0, ARGS_OFFSET + 8 * rule.argument + (0 if sys.byteorder == "little" else 4)),
                 test, fail, _instruction(LOAD_WORD, 0, 0, NR_OFFSET)]
    code.append(_instruction(RETURN, 0, 0, SECCOMP_RET_ALLOW))
    return b"".join(code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _prctl(*arguments):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(*arguments, *[0] * (5 - len(arguments))) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"prctl({arguments[0]}): {os.strerror(number)}")


def install(filter_program):
    """Apply the filter (bytes from `program`) to this thread and all it executes; OSError if refused."""
    buffer = ctypes.create_string_buffer(filter_program, len(filter_program))
    fprog = _SockFprog(len(filter_program) // 8, ctypes.addressof(buffer))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


def drop_capability(number):
    """Drop capability `number` from the bounding set: a root process loses it at its next execve."""
    _prctl(PR_CAPBSET_DROP, number)


def main(argv):
    """PROGRAM_HEX [--drop-capability N ...] -- COMMAND...: run COMMAND under the filter."""
    import argparse

    parser = argparse.ArgumentParser(prog="seccomp.py", description="run a command under a seccomp filter")
    parser.add_argument("program", help="the filter: kdacourse.seccomp.program(rules).hex()")
    parser.add_argument("--drop-capability", type=int, action="append", default=[], metavar="N",
                        help="a capability to drop from the bounding set first (21: CAP_SYS_ADMIN)")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    for number in args.drop_capability:
        drop_capability(number)
    install(bytes.fromhex(args.program))
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    main(sys.argv[1:])
