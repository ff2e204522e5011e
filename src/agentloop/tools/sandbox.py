"""The Shell sandbox (``shell_sandbox``): Linux Landlock, applied by the command's own process.

A sandboxed command is not started as ``bash -c CMD`` but as this file run by the same interpreter,
``python -I -S -c <this file> --write DIR … [--private [--read DIR …]] [--offline] -- bash -c CMD``:
it restricts itself with Landlock (``landlock_create_ruleset``, ``landlock_add_rule``,
``prctl(PR_SET_NO_NEW_PRIVS)``, ``landlock_restrict_self``) and then execs the shell. So nothing
runs in the child between ``fork`` and ``exec`` (no ``preexec_fn``, unsafe in a threaded runtime),
the pid stays the shell's (the process group and its mark work as without a sandbox), and the
restriction is inherited by everything the command starts; it cannot be lifted.

The modes:

- ``off`` (the default): no sandbox.
- ``workspace``: the whole file system may be read and executed; it may be written (files created,
  changed, truncated, renamed, removed) only beneath the directories given with ``--write`` (the
  Shell's workspace root and the command's private ``$TMPDIR``) and in the devices in ``DEVICES``
  (``/dev/null``, ``/dev/zero``, ``/dev/full``, ``/dev/tty``: what shells and ordinary tools open
  for writing). Elsewhere the command gets the ordinary ``EACCES`` ("Permission denied"). With
  Landlock ABI 6 or later the command may also not send signals to processes outside its sandbox
  (the runtime, the user's other programs).
- ``workspace-offline``: also no TCP ``connect`` or ``bind`` (ABI 4 or later) and, with ABI 6, no
  connecting to abstract Unix sockets outside the sandbox; a seccomp filter (x86-64, ARM64) refuses
  the TCP Landlock does not see (``_offline_filter``: Multipath TCP and SMC sockets, TCP Fast Open,
  io_uring). A ``listen`` without ``bind`` still gets a port (the kernel's choice).
- ``private``: as ``workspace``, and reading is confined too (``--private``): files may be read,
  directories listed and programs run only beneath the writable directories, the system
  (``SYSTEM_PROGRAMS``: read and executed; ``SYSTEM_FILES``: read), the interpreter's own files (its
  executable, standard library and ``LIBDIR``: what a ``python`` command needs) and the extra
  read-only directories given with ``--read`` (``shell_sandbox_read`` of ``Kernel.open``). The
  user's home outside the workspace (``~/.ssh``, ``~/.aws``, browser profiles, other projects),
  other users' homes, ``/root``, ``/tmp`` outside ``$TMPDIR``, ``/var``, ``/run``, ``/mnt``,
  ``/media``, ``/srv`` answer ``EACCES``, also through a symlink (Landlock checks the file a path
  resolves to). The name: the command sees none of the user's private files, only the workspace and
  the system.
- ``private-offline``: ``private`` and ``workspace-offline``'s network confinement.

Which system directories the private modes let be read, and why: ``/usr``, ``/bin``, ``/sbin``,
``/lib*``, ``/opt`` and ``/nix/store`` hold programs and libraries (installed software, readable by
everyone; ``/nix/store`` is where every program lives on NixOS). ``/etc`` is world-readable
configuration every tool reads (the loader's cache, ``passwd``, ``nsswitch.conf``, certificates);
the secrets in it (``shadow``, host keys) are readable by root only - so run the runtime as an
ordinary user. ``/proc`` (``/proc/self``, ``/dev/fd``, ``ps``) and ``/sys`` (the CPU count, device
facts) are the kernel's views; another process's ``environ`` or memory stays out of reach, as
Landlock lets a sandboxed process ``ptrace`` (and so read those of) only processes in its own
sandbox (root's ``CAP_SYS_ADMIN`` and ``CAP_PERFMON`` would read past that: they are dropped, see
below); its command line (``ps``) does not. Of ``/dev`` only ``DEVICES`` and ``SYSTEM_DEVICES`` (the
null, zero and random devices, ``/dev/tty``) are: not ``/dev/shm`` (files programs keep in shared
memory), the user's terminals, a camera or microphone, the disks. ``/run`` is left out: it holds the
user's runtime directory (``/run/user/UID``: keyrings, agents' state, a container registry's
credentials); only ``/etc/resolv.conf``'s target is let be read when it lies elsewhere
(``/run/systemd/resolve/stub-resolv.conf``: name resolution). A directory missing here is skipped.

The wrapper is run from this file's text as the runtime imported it (``-c``), on the real (base)
interpreter, which must not lie beneath a writable directory (``Unconfinable``): what runs before
the command is confined cannot be changed by an earlier command. A writable or extra readable
directory must be given by its real path (the wrapper refuses one reached through a symlink, which a
command could swap in).

What is *not* confined: reading, in the ``workspace`` modes (any file this user may read, secrets
included; the ``private`` modes confine it as above, yet leave the directory tree walkable: a name
can be looked up, ``cd`` into, ``stat``-ed, only not read or listed), UDP and other non-TCP
protocols, connecting to Unix sockets that have a path (``/var/run/docker.sock``; in the private
modes too: an ``ssh-agent``'s socket, should the command know its path, signs with keys it cannot
read), ioctls, and every other system call; processes started before (a server the command talks to
is not sandboxed). Setuid programs (``sudo``) cannot gain privileges (``no_new_privs``).

A command run by root keeps only the capabilities ordinary root work needs (``_KEPT_CAPABILITIES``:
owners, modes, users, low ports), in every mode: Landlock confines paths, and root's other
capabilities reach past it (a kernel module, raw disk access, reading the runtime's environment;
offline, a raw socket's hand-made TCP). No mode lets a device node be made (``mknod``), not even in
the writable directories, where it would be the disk itself.

Only the standard library is used: the wrapper runs with ``-I -S`` (no ``site``, no
``agentloop`` package), to start in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = [
    "DEVICES",
    "MODES",
    "SYSTEM_DEVICES",
    "SYSTEM_FILES",
    "SYSTEM_PROGRAMS",
    "Unconfinable",
    "check_mode",
    "is_offline",
    "is_private",
    "landlock_status",
    "main",
    "restrict",
    "unavailable",
    "wrapper_argv",
]

MODES = ("off", "workspace", "workspace-offline", "private", "private-offline")
#: read and executed in the private modes (programs and libraries); a missing one is skipped
SYSTEM_PROGRAMS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/nix/store")
#: read, not executed, in the private modes (configuration, the kernel's views)
SYSTEM_FILES = ("/etc", "/proc", "/sys")
#: the devices the private modes let be read besides ``DEVICES`` (not all of ``/dev``: it holds
#: ``/dev/shm``, where programs keep files in shared memory, the user's terminals ``/dev/pts/N``, the
#: camera and microphone, and, for root, the disks); ``/dev/fd`` and ``/dev/stdin`` lead to ``/proc``
SYSTEM_DEVICES = ("/dev/random", "/dev/urandom")
#: a symlink on many systems (systemd-resolved: into ``/run``, which the private modes leave out)
_RESOLV_CONF = "/etc/resolv.conf"
#: written by shells and ordinary tools (``> /dev/null``); a missing one is skipped
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")
#: the exit status of a sandboxed command that could not be confined (and so was not run)
REFUSED_STATUS = 126

# the Landlock UAPI (include/uapi/linux/landlock.h); the syscall numbers are the same on every
# architecture (from the unified table)
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_REMOVE_DIR = 1 << 4
_FS_REMOVE_FILE = 1 << 5
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_DIR = 1 << 7
_FS_MAKE_REG = 1 << 8
_FS_MAKE_SOCK = 1 << 9
_FS_MAKE_FIFO = 1 << 10
_FS_MAKE_BLOCK = 1 << 11
_FS_MAKE_SYM = 1 << 12
_FS_REFER = 1 << 13  # ABI 2: link or rename into another directory
_FS_TRUNCATE = 1 << 14  # ABI 3
# (ABI 5's LANDLOCK_ACCESS_FS_IOCTL_DEV is left unhandled: ioctls on devices stay as they are)
_FS_V1 = (1 << 13) - 1
_READ_EXECUTE = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE  # (what a non-directory rule may hold)
#: never granted, not even in the writable directories: a device node made there (by root: ``mknod
#: disk b 8 0``) would be read and written there, and be the whole disk or the memory
_FS_MAKE_DEVICE = _FS_MAKE_CHAR | _FS_MAKE_BLOCK
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1


# ``workspace-offline``'s seccomp filter: the TCP that Landlock's connect rule does not see. Multipath
# TCP (``IPPROTO_MPTCP``) and SMC sockets are not TCP to Landlock, yet reach any TCP server; a
# ``sendto``/``sendmsg`` with ``MSG_FASTOPEN`` connects a TCP socket without ``connect``; io_uring
# makes sockets and sends outside the system calls a filter sees. Per architecture: (audit arch,
# socket, sendto, sendmsg, sendmmsg, io_uring_setup, x32 bit)
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 41, 44, 46, 307, 425, 0x40000000),
    "aarch64": (0xC00000B7, 198, 206, 211, 269, 425, 0),
}
_AF_INET, _AF_INET6, _AF_SMC = 2, 10, 43
_IPPROTO_SMC, _IPPROTO_MPTCP = 256, 262
_MSG_FASTOPEN = 0x20000000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_Row = tuple[int, "int | str", "int | str", int]


def _offline_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The seccomp program (``struct sock_filter`` rows) that refuses, with ``EACCES``, the TCP
    Landlock lets through (``_SECCOMP_ARCH``); ``RuntimeError`` for an architecture it does not know."""
    if machine not in _SECCOMP_ARCH:
        raise RuntimeError(f"blocking the network needs a seccomp filter this sandbox has none for on {machine}")
    arch, socket_nr, sendto, sendmsg, sendmmsg, io_uring_setup, x32 = _SECCOMP_ARCH[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # (BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K)

    def arg(n: int) -> int:  # (the low 32 bits of argument n: the kernel takes these as 32-bit ints)
        return 16 + 8 * n

    program: list[_Row | str] = [  # (a string: a label; a jump names the label it goes to, 0: the next row)
        (ld, 0, 0, 4),  # the architecture: another ABI's calls (32-bit compat), numbered otherwise, are refused
        (jeq, 0, "deny", arch),
        (ld, 0, 0, 0),  # the call
        *([(jge, "deny", 0, x32)] if x32 else []),
        (jeq, "socket", 0, socket_nr),
        (jeq, "flags3", 0, sendto),
        (jeq, "flags3", 0, sendmmsg),
        (jeq, "flags2", 0, sendmsg),
        (jeq, "deny", "allow", io_uring_setup),
        "socket",  # socket(domain, type, protocol)
        (ld, 0, 0, arg(0)),
        (jeq, "deny", 0, _AF_SMC),
        (jeq, "protocol", 0, _AF_INET),
        (jeq, "protocol", "allow", _AF_INET6),
        "protocol",
        (ld, 0, 0, arg(2)),
        (jeq, "deny", 0, _IPPROTO_MPTCP),
        (jeq, "deny", "allow", _IPPROTO_SMC),
        "flags3",  # sendto(fd, buf, len, flags, …), sendmmsg(fd, msgs, n, flags)
        (ld, 0, 0, arg(3)),
        (jset, "deny", "allow", _MSG_FASTOPEN),
        "flags2",  # sendmsg(fd, msg, flags)
        (ld, 0, 0, arg(2)),
        (jset, "deny", "allow", _MSG_FASTOPEN),
        "deny",
        (ret, 0, 0, _SECCOMP_RET_ERRNO | errno.EACCES),
        "allow",
        (ret, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    labels: dict[str, int] = {}
    rows: list[_Row] = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(rows)
        else:
            rows.append(item)

    def offset(target: int | str, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1

    return [(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(rows)]


def _filter_offline(libc: ctypes.CDLL) -> None:
    """Install ``_offline_filter`` (after ``no_new_privs``); ``OSError`` or ``RuntimeError``."""
    rows = _offline_filter(os.uname().machine)
    program = (_SockFilter * len(rows))(*(_SockFilter(*row) for row in rows))
    fprog = _SockFprog(len(rows), program)
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0):
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_SECCOMP): {os.strerror(ctypes.get_errno())}")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # (``__attribute__((packed))``: 12 bytes)
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def check_mode(mode: object) -> str:
    """``mode`` if it names a sandbox mode; ``ValueError`` saying which ones there are otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"shell_sandbox must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


def is_offline(mode: str) -> bool:
    """Whether the sandbox ``mode`` also keeps commands off TCP."""
    return check_mode(mode).endswith("-offline")


def is_private(mode: str) -> bool:
    """Whether the sandbox ``mode`` also confines reading (to the workspace, the system, ``--read``)."""
    return check_mode(mode).startswith("private")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(libc: ctypes.CDLL, number: int, *args: int | ctypes.c_void_p) -> int:
    fn = libc.syscall
    fn.restype = ctypes.c_long
    result = int(fn(ctypes.c_long(number), *(a if isinstance(a, ctypes.c_void_p) else ctypes.c_long(a) for a in args)))
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


@functools.cache
def landlock_status() -> tuple[int, str]:
    """This machine's Landlock ABI version (0: none) and, when there is none, why."""
    if not sys.platform.startswith("linux"):
        return 0, f"Landlock is a Linux feature and this system is {sys.platform}"
    try:
        abi = _syscall(_libc(), _SYS_CREATE_RULESET, ctypes.c_void_p(None), 0, _CREATE_RULESET_VERSION)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return 0, "this kernel has no Landlock (it needs Linux 5.13 or later built with CONFIG_SECURITY_LANDLOCK)"
        if exc.errno == errno.EOPNOTSUPP:
            return 0, "Landlock is disabled in this kernel (add landlock to the lsm= boot parameter)"
        return 0, f"the Landlock probe failed: {exc.strerror or exc}"
    except (AttributeError, TypeError) as exc:  # (no libc ``syscall``)
        return 0, f"the Landlock probe failed: {exc}"
    return abi, ""


def unavailable(mode: str) -> str | None:
    """Why the sandbox ``mode`` cannot be had on this machine, or None (also for ``off``)."""
    if check_mode(mode) == "off":
        return None
    abi, why = landlock_status()
    if abi < 1:
        return why or "Landlock is not available on this system"
    if is_offline(mode) and abi < 4:
        return f"blocking the network needs Landlock ABI 4 (Linux 6.7) or later; this kernel has ABI {abi}"
    if is_offline(mode) and os.uname().machine not in _SECCOMP_ARCH:
        return f"blocking the network is not supported on {os.uname().machine} (only on {', '.join(_SECCOMP_ARCH)})"
    return None


class Unconfinable(RuntimeError):
    """What runs before the command is confined (the interpreter, its standard library) could be
    changed by a command: it lies beneath a directory the sandbox lets commands write."""


def _own_source() -> str | None:
    try:
        with open(__file__, encoding="utf-8") as file:
            return file.read()
    except (NameError, OSError):  # (run with -c: the wrapper itself; or no file to read)
        return None


#: this file as the runtime imported it: the wrapper is run from this text (``-c``), not from the
#: file, which may lie in a workspace (an editable install) where a command could change it
_SOURCE = _own_source() if __name__ != "__main__" else None


@functools.cache
def _interpreter() -> tuple[str, tuple[str, ...]]:
    """The interpreter the wrapper runs on (a virtual environment's base one: the wrapper needs only
    the standard library) and what it loads before the command is confined, as real paths."""
    import sysconfig  # (here, not at the top: the wrapper itself never needs it)

    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    paths = sysconfig.get_paths()
    loaded = {executable, paths["stdlib"], paths["platstdlib"], sysconfig.get_config_var("LIBDIR") or ""}
    return executable, tuple(os.path.realpath(p) for p in sorted(loaded) if p)


def _beneath(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def wrapper_argv(
    mode: str,
    writable: Sequence[str | os.PathLike[str]],
    argv: Sequence[str],
    readable: Sequence[str | os.PathLike[str]] = (),
) -> list[str]:
    """The command line that runs ``argv`` under the sandbox ``mode`` (not ``off``), writable beneath
    ``writable``: this file's text as the runtime read it, run by this interpreter (``-I -S -c``),
    which confines itself and then execs ``argv``. In a private mode it may read beneath the system,
    the interpreter's own files and ``readable`` (else ``readable`` is moot: all may be read).
    ``Unconfinable`` when the interpreter or its standard library lies beneath a writable directory:
    a command could change what the next one is confined by."""
    if check_mode(mode) == "off":
        raise ValueError("no wrapper for shell_sandbox 'off'")
    executable, loaded = _interpreter()
    for directory in (os.path.realpath(path) for path in writable):
        exposed = next((path for path in loaded if _beneath(path, directory)), None)
        if exposed is not None:
            raise Unconfinable(
                f"the sandbox cannot be set up: {exposed} (the Python that confines each command) lies beneath "
                f"{directory}, which commands may write; run the runtime on a Python installed outside the workspace"
            )
    start = [executable, "-I", "-S", "-c", _SOURCE] if _SOURCE is not None else [sys.executable, "-m", __name__]
    options = [item for path in writable for item in ("--write", os.path.abspath(path))]
    if is_private(mode):  # (the interpreter's files first: a ``python`` command needs them, as CodeMode does)
        options.append("--private")
        options += [item for path in (*loaded, *readable) for item in ("--read", os.path.abspath(path))]
    if is_offline(mode):
        options.append("--offline")
    return [*start, *options, "--", *argv]


def restrict(
    writable: Sequence[str],
    *,
    offline: bool = False,
    readable: Sequence[str] | None = None,
    devices: Sequence[str] = DEVICES,
) -> int:
    """Confine this process (and all it will start) for good: write beneath ``writable`` and into
    ``devices``; read and execute anywhere or, with ``readable`` (the private modes), only beneath
    the system (``_allow_system``), ``writable`` and ``readable``; with ``offline`` no TCP. The ABI
    used; ``OSError`` or ``RuntimeError`` when it cannot be done (then nothing may run: the caller
    must stop)."""
    abi, why = landlock_status()
    if abi < 1:
        raise RuntimeError(why or "Landlock is not available")
    handled = _FS_V1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net = 0
    if offline:
        if abi < 4:
            raise RuntimeError(f"blocking the network needs Landlock ABI 4 or later; this kernel has ABI {abi}")
        net = _NET_BIND_TCP | _NET_CONNECT_TCP
    scoped = (_SCOPE_SIGNAL | (_SCOPE_ABSTRACT_UNIX_SOCKET if offline else 0)) if abi >= 6 else 0
    attr = _RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else ctypes.sizeof(_RulesetAttr))
    libc = _libc()
    ruleset = _syscall(libc, _SYS_CREATE_RULESET, ctypes.c_void_p(ctypes.addressof(attr)), size, 0)
    try:
        if readable is None:
            _allow(libc, ruleset, "/", _READ_EXECUTE, required=True)
        else:
            _allow_system(libc, ruleset)
            for path in readable:  # (read-only: what is not handled in ``writable``'s rights is denied)
                _allow(libc, ruleset, path, _READ_EXECUTE, required=True)
        for path in writable:
            _allow(libc, ruleset, path, handled & ~_FS_MAKE_DEVICE, required=True)
        for device in devices:
            _allow(libc, ruleset, device, (_FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE) & handled, required=False)
        _drop_capabilities(libc, offline=offline)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
            raise OSError(ctypes.get_errno(), f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        if offline:
            _filter_offline(libc)
        _syscall(libc, _SYS_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
    return abi


def _allow_system(libc: ctypes.CDLL, ruleset: int) -> None:
    """The private modes' system rules: programs read and run, configuration and the kernel's views
    read (the module's docstring says why each); root-owned, so symlinks among them (``/bin`` to
    ``usr/bin``) are followed, and a missing one is skipped."""
    for path in SYSTEM_PROGRAMS:
        _allow(libc, ruleset, path, _READ_EXECUTE, required=False)
    for path in SYSTEM_FILES:
        _allow(libc, ruleset, path, _FS_READ_FILE | _FS_READ_DIR, required=False)
    for path in SYSTEM_DEVICES:
        _allow(libc, ruleset, path, _FS_READ_FILE, required=False)
    resolv = os.path.realpath(_RESOLV_CONF)
    if resolv != _RESOLV_CONF:  # (only that file: the rest of where it lies, ``/run``, stays hidden)
        _allow(libc, ruleset, resolv, _FS_READ_FILE, required=False)


# The capabilities a command run by root keeps (Docker's default set, less ``CAP_MKNOD``): what
# ordinary root work needs (``chown``, ``tar`` keeping owners, files of other users in the workspace,
# ``su``, low ports, ``ping``). Landlock confines paths, not capabilities, and the others reach past
# it: ``CAP_SYS_ADMIN`` and ``CAP_PERFMON`` read another process's ``environ`` and memory map (the
# runtime's API keys) despite its ptrace rule, ``CAP_SYS_MODULE`` loads kernel code,
# ``CAP_SYS_RAWIO``, ``CAP_BPF``, ``CAP_MKNOD`` (a disk's device node), ``CAP_DAC_READ_SEARCH``
# (``open_by_handle_at``), ``CAP_SYS_PTRACE``, ``CAP_NET_ADMIN``. Offline, ``CAP_NET_RAW`` goes too:
# a raw or packet socket makes TCP by hand, past the ``connect`` rule and the seccomp filter.
_CAP_NET_RAW = 13
_KEPT_CAPABILITIES = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, _CAP_NET_RAW, 18, 29, 31})
_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_READ, _PR_CAPBSET_DROP = 23, 24
_ZEROS = (ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(libc: ctypes.CDLL, *, offline: bool) -> None:
    """Lower this process's capabilities to ``_KEPT_CAPABILITIES`` (less ``CAP_NET_RAW`` when
    ``offline``): nothing for an ordinary user, who has none. Lowering needs no privilege; with
    ``no_new_privs`` an ``execve`` (of root's programs, of one with file capabilities) gains none back.
    The bounding set is lowered too where that may be done (``CAP_SETPCAP``), for good measure."""
    kept = 0
    for cap in _KEPT_CAPABILITIES - ({_CAP_NET_RAW} if offline else set()):
        kept |= 1 << cap
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data):
        raise OSError(ctypes.get_errno(), f"capget: {os.strerror(ctypes.get_errno())}")
    held = 0
    for i, half in enumerate(data):
        held |= (half.effective | half.permitted | half.inheritable) << (32 * i)
    if not held & ~kept:
        return
    for cap in range(64):  # (the bounding set first: dropping from it needs CAP_SETPCAP, still held)
        if not kept & (1 << cap) and libc.prctl(_PR_CAPBSET_READ, ctypes.c_ulong(cap), *_ZEROS) == 1:
            libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), *_ZEROS)  # (refused without CAP_SETPCAP: see above)
    for i, half in enumerate(data):
        mask = (kept >> (32 * i)) & 0xFFFFFFFF
        half.effective &= mask
        half.permitted &= mask
        half.inheritable &= mask
    if libc.capset(ctypes.byref(header), data):
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, access: int, *, required: bool) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        if required:
            raise OSError(exc.errno, f"{path}: {exc.strerror}") from None
        return
    try:
        if required and os.readlink(f"/proc/self/fd/{fd}") != path:  # (a symlink: swapped in by a command?)
            raise OSError(errno.ELOOP, f"{path} is reached through a symlink (to {os.readlink(f'/proc/self/fd/{fd}')})")
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FILE_RIGHTS  # (the kernel refuses directory rights on a file)
        rule = _PathBeneathAttr(access, fd)
        try:
            _syscall(libc, _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.c_void_p(ctypes.addressof(rule)), 0)
        except OSError as exc:
            raise OSError(exc.errno, f"a Landlock rule for {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``sandbox.py --write DIR … [--private [--read DIR …]] [--offline] -- PROGRAM ARGS…``: confine,
    then exec PROGRAM (an absolute path). ``--private`` confines reading to the system, the ``--write``
    and the ``--read`` directories. Exit 126 with the reason on stderr, PROGRAM not run, when
    confining fails (also for a ``--read`` without ``--private``: reading would not be confined)."""
    args = list(sys.argv[1:] if argv is None else argv)
    writable: list[str] = []
    readable: list[str] = []
    offline = private = False
    while args and args[0] != "--":
        option = args.pop(0)
        if option in ("--write", "--read") and args:
            (writable if option == "--write" else readable).append(args.pop(0))
        elif option == "--offline":
            offline = True
        elif option == "--private":
            private = True
        else:
            _refuse(f"unknown option {option!r}")
    if len(args) < 2:
        _refuse("usage: sandbox.py --write DIR ... [--private [--read DIR ...]] [--offline] -- PROGRAM [ARGS...]")
    if readable and not private:
        _refuse("--read confines reading only with --private")
    program = args[1:]
    try:
        restrict(writable, offline=offline, readable=readable if private else None)
    except (OSError, RuntimeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        _refuse(f"cannot confine the command ({why}); it was not run")
    try:
        os.execv(program[0], program)
    except OSError as exc:
        sys.stderr.write(f"agentloop sandbox: cannot run {program[0]}: {exc.strerror or exc}\n")
        sys.stderr.flush()
        os._exit(127)


def _refuse(message: str) -> NoReturn:
    sys.stderr.write(f"agentloop sandbox: {message}\n")
    sys.stderr.flush()
    os._exit(REFUSED_STATUS)


if __name__ == "__main__":
    main()
