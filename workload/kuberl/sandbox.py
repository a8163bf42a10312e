"""A sandboxed Python process for the ``python`` tool.

The code runs in a fresh interpreter (``-I -S -B``: no site-packages, no user environment, no
inherited env vars, no bytecode written) in an empty temporary directory, under limits it cannot
raise: CPU seconds, address space, file size (its output goes to a file, so a flood of output stops
at the limit), open files; a wall-clock timeout kills its process group.

Before the code runs, the launcher installs a seccomp filter (libseccomp, through ctypes; the
kernel keeps it for the process's life and no process can lift it) that refuses, with EPERM:

* the network: ``socket`` (every family) and io_uring (which can open sockets on its own);
* other processes: ``fork``/``clone``/``exec`` (nothing is left behind, no fork bomb), signals
  (``kill``, ``tkill``, ``tgkill``, pidfd, sigqueue), ``ptrace`` and ``process_vm_*``, another
  process's limits (``prlimit64`` with a pid), priority, CPU affinity, scheduling policy, I/O
  priority and memory placement (``setpriority``, ``sched_set*``, ``ioprio_set``,
  ``migrate_pages``, ``move_pages``) — it cannot stop, signal, read, starve or kill through its
  limits the trainer that runs it (a same-uid ``prlimit(RLIMIT_CPU)`` on the parent killed it);
* the filesystem, but for reading: ``open``/``openat`` with any write flag, ``openat2``, and
  every call that creates, removes, renames, links or changes the mode, owner, times or
  attributes of a file;
* namespaces, mounts, BPF, perf, keys, ``personality`` and ``userfaultfd``.

Reads are confined too where the kernel has Landlock (5.13+; ``reads_confined``): the code may read
Python's standard library, the shared libraries and its scratch directory, nothing else — not the
trainer's files, not ``/proc/<pid>/environ`` (the API token). Without Landlock the trainer warns at
start that tool code can read what the trainer's user can.

Neither needs a privilege (only ``no_new_privs``), so this works in a pod under the RuntimeDefault
seccomp profile with every capability dropped — where the namespaces the tool used before
(``unshare``) are refused. Where libseccomp is missing, the tool refuses to run (``available``: the
trainer checks at start, so a run does not train on errors).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NO_ISOLATION = 125  # the launcher's exit code when it cannot install the filter
DENIED = (  # refused outright (names unknown on an architecture are skipped: e.g. "open" on arm64)
    "socket io_uring_setup io_uring_enter io_uring_register "
    "fork vfork clone clone3 execve execveat "
    "kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo pidfd_open pidfd_send_signal pidfd_getfd "
    "ptrace process_vm_readv process_vm_writev kcmp "
    "openat2 creat truncate unlink unlinkat rename renameat renameat2 mkdir mkdirat rmdir link linkat "
    "symlink symlinkat mknod mknodat chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat "
    "setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr utime utimes utimensat futimesat "
    "name_to_handle_at open_by_handle_at "
    "mount umount2 unshare setns chroot pivot_root move_mount fsopen fsmount fspick open_tree "
    "bpf perf_event_open userfaultfd keyctl add_key request_key personality fanotify_init "
    "setpriority ioprio_set sched_setaffinity sched_setscheduler sched_setparam sched_setattr "
    "migrate_pages move_pages process_madvise process_mrelease"
).split()
OTHER_PID = {"prlimit64": 0}  # refused unless its pid argument (this index) is 0, the caller itself
WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)
OPENS = {"open": 1, "openat": 2}  # syscall → index of its flags argument
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # one number on every arch

LAUNCHER = f"""
import ctypes, os, resource, sys
cpu, memory, fsize = (int(x) for x in sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
def confine_reads(readable):
    # Landlock (unprivileged, kernel >= 5.13): from now on only files under ``readable`` may be read;
    # nothing else is reachable, /proc (other processes' environment, the token) included. Best
    # effort: a kernel or seccomp profile without it leaves the seccomp filter alone.
    abi = libc.syscall({LANDLOCK_CREATE_RULESET}, None, 0, 1)
    if abi < 1:
        return False
    handled = (1 << {{1: 13, 2: 14, 3: 15, 4: 15}}.get(abi, 16)) - 1  # every fs right this ABI knows
    ruleset = libc.syscall({LANDLOCK_CREATE_RULESET}, ctypes.byref(ctypes.c_uint64(handled)), 8, 0)
    if ruleset < 0:
        return False
    for path in readable:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rights = (1 << 0 | 1 << 2 | 1 << 3) if os.path.isdir(path) else (1 << 2)  # execute, read file/dir
        rule = (ctypes.c_uint64(rights).value.to_bytes(8, sys.byteorder) + fd.to_bytes(4, sys.byteorder, signed=True))
        libc.syscall({LANDLOCK_ADD_RULE}, ruleset, 1, ctypes.c_char_p(rule), 0)
        os.close(fd)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    return libc.syscall({LANDLOCK_RESTRICT_SELF}, ruleset, 0) == 0
confine_reads([os.getcwd(), os.path.dirname(os.__file__), "/usr/lib", "/usr/lib64", "/lib", "/lib64",
               "/dev/null", "/dev/zero", "/dev/urandom"])
DENIED, WRITE_FLAGS, OPENS, OTHER_PID = {DENIED!r}, {WRITE_FLAGS!r}, {OPENS!r}, {OTHER_PID!r}
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
try:
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW by default
    refuse = 0x00050000 | 1  # SCMP_ACT_ERRNO(EPERM)
    ok = ctx is not None
    for name in DENIED:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0:
            ok = ok and lib.seccomp_rule_add_array(ctx, refuse, nr, 0, None) == 0
    for name, index in OPENS.items():
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        for flag in WRITE_FLAGS if nr >= 0 else ():
            cmp = (Cmp * 1)(Cmp(index, 7, flag, flag))  # SCMP_CMP_MASKED_EQ: flags & flag == flag
            ok = ok and lib.seccomp_rule_add_array(ctx, refuse, nr, 1, cmp) == 0
    for name, index in OTHER_PID.items():
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        cmp = (Cmp * 1)(Cmp(index, 1, 0, 0))  # SCMP_CMP_NE: pid != 0
        ok = ok and (nr < 0 or lib.seccomp_rule_add_array(ctx, refuse, nr, 1, cmp) == 0)
    ok = ok and lib.seccomp_load(ctx) == 0
except OSError:
    ok = False
if not ok:
    sys.exit({NO_ISOLATION})
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
code = sys.argv[4]
del ctypes, os, lib, libc, ctx, cpu, memory, fsize, Cmp, DENIED, WRITE_FLAGS, OPENS, OTHER_PID, confine_reads
sys.argv = ["tool"]
exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__"}})
"""
UNAVAILABLE = ("the python tool needs libseccomp (libseccomp.so.2) to confine the code it runs, and this host "
               "has none; it does not run code unconfined")


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 2
    memory_bytes: int = 512 * 2**20
    wall_seconds: float = 5.0
    output_bytes: int = 4096


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str


def _read(path: Path, limit: int) -> str:
    data = path.read_bytes() if path.exists() else b""
    text = data[:limit].decode(errors="replace")
    return text + (f"\n[output cut at {limit} bytes]" if len(data) > limit else "")


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run ``code``; Outcome(ok, output or what stopped it)."""
    with tempfile.TemporaryDirectory(prefix="kuberl-tool-") as cwd:
        out_path = Path(cwd) / ".output"
        with out_path.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", LAUNCHER, str(limits.cpu_seconds),
                 str(limits.memory_bytes), str(limits.output_bytes * 4), code],
                cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
            try:
                code_ = proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return Outcome(False, f"timed out after {limits.wall_seconds:g} s")
        text = _read(out_path, limits.output_bytes)
    if code_ == NO_ISOLATION:
        return Outcome(False, UNAVAILABLE)
    if code_ < 0:
        name = signal.Signals(-code_).name
        reason = {"SIGXCPU": "the CPU time limit", "SIGXFSZ": "the output limit", "SIGKILL": "a limit"}.get(name, name)
        return Outcome(False, f"stopped by {reason} ({name})\n{text}".strip())
    if code_ != 0:
        return Outcome(False, "\n".join(text.strip().splitlines()[-5:]))  # the end of the traceback
    return Outcome(True, text)


def available() -> str | None:
    """Why the sandbox cannot run code on this host, or None when it can (one trial run)."""
    outcome = run_python("print('ok')")
    return None if outcome.ok and outcome.output == "ok\n" else outcome.output


def reads_confined() -> bool:
    """Whether tool code is kept from reading files outside Python's library (Landlock; one trial run)."""
    outcome = run_python("open('/proc/self/status')")
    return not outcome.ok and "PermissionError" in outcome.output
