"""The first code a sandboxed interpreter runs (:mod:`kuberl.sandbox` passes this file's text to
``python -I -S -B -c``): it confines its own process, then runs the code file it was given.

``argv``: CPU seconds, address-space bytes, file-size bytes, the parent's pid, the code file (in the
scratch directory, the working directory), then the code's own arguments (its ``sys.argv[1:]``).
Code travels by file, so it may hold NUL bytes and exceed the kernel's 128 KiB per argument.

In this order, each before the code can run:

1. ``PR_SET_PDEATHSIG`` = SIGKILL, then a check that the parent is still the one that started it:
   no sandbox outlives the process (reward worker, rollout) that waits for it.
2. ``oom_score_adj`` = 1000: under memory pressure the kernel's OOM killer takes a sandbox first,
   never the trainer beside it.
3. Landlock (kernel 5.13+): reads confined to ``READABLE``; where the kernel has scopes (6.12+, ABI 6),
   also no signal to any process outside the sandbox's domain — by any route, ``F_SETOWN`` + ``O_ASYNC``
   SIGIO included — and no abstract unix socket outside it.
4. A seccomp filter (libseccomp through ctypes): the calls in ``DENIED``, writes through ``open``,
   another process's limits, and the ``fcntl``/``ioctl`` commands that make the kernel signal on
   the caller's behalf (``SIGNALLING_FCNTL``, ``SIGNALLING_IOCTL``) — the signal routes closed on every
   kernel, Landlock or not.
5. CPU, address-space, file-size and open-file limits, which the code may lower but never raise.

Exit code ``NO_ISOLATION`` when the filter cannot be installed (no libseccomp): nothing runs unconfined.
"""

import ctypes
import os
import resource
import sys

NO_ISOLATION = 125
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
# F_SETOWN, F_SETSIG, F_SETOWN_EX: SIGIO/SIGURG (or any chosen signal) to a pid or process group when
# an fd is ready; F_SETLEASE: a lease, whose break blocks another process's open; F_NOTIFY: dnotify.
SIGNALLING_FCNTL = {"F_SETOWN": 8, "F_SETSIG": 10, "F_SETOWN_EX": 15, "F_SETLEASE": 1024, "F_NOTIFY": 1026}
# FIOSETOWN and SIOCSPGRP: F_SETOWN by ioctl; TIOCSTI: typing into a terminal another process reads.
SIGNALLING_IOCTL = {"FIOSETOWN": 0x8901, "SIOCSPGRP": 0x8902, "TIOCSTI": 0x5412}
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # one number on every arch
LANDLOCK_SCOPES = 1 << 0 | 1 << 1  # ABI 6: abstract unix sockets, signals
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SCMP_ACT_ALLOW, SCMP_ACT_EPERM = 0x7FFF0000, 0x00050000 | 1
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7

libc = ctypes.CDLL(None, use_errno=True)


class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent goes; exit at once if it already went (its pid would be another's)."""
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(NO_ISOLATION)


def first_to_die() -> None:
    try:  # raising one's own score needs no privilege; a host without /proc has no OOM score to set
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("1000")
    except OSError:
        pass


def confine(readable: list[str]) -> bool:
    """Landlock: only files under ``readable`` may be read; with ABI 6+, no signal leaves the domain.
    False where the kernel (or a seccomp profile) has no Landlock: seccomp still holds."""
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)
    if abi < 1:
        return False
    handled = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # every fs right this ABI knows
    attr = (ctypes.c_uint64 * 3)(handled, 0, LANDLOCK_SCOPES if abi >= 6 else 0)  # fs, net, scoped
    size = 24 if abi >= 6 else 8
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return False
    for path in readable:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rights = (1 << 0 | 1 << 2 | 1 << 3) if os.path.isdir(path) else (1 << 2)  # execute, read file/dir
        rule = rights.to_bytes(8, sys.byteorder) + fd.to_bytes(4, sys.byteorder, signed=True)
        libc.syscall(LANDLOCK_ADD_RULE, ruleset, 1, ctypes.c_char_p(rule), 0)
        os.close(fd)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) == 0


def filtered() -> bool:
    """Install the seccomp filter; False when libseccomp is missing or refuses a rule."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if ctx is None:
        return False

    def refuse(name: str, *rule: tuple[int, int, int, int]) -> bool:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        cmps = (Cmp * len(rule))(*(Cmp(*part) for part in rule)) if rule else None
        return nr < 0 or lib.seccomp_rule_add_array(ctx, SCMP_ACT_EPERM, nr, len(rule), cmps) == 0

    ok = all(refuse(name) for name in DENIED)
    ok = ok and all(refuse(name, (index, SCMP_CMP_MASKED_EQ, flag, flag))
                    for name, index in OPENS.items() for flag in WRITE_FLAGS)
    ok = ok and all(refuse(name, (index, SCMP_CMP_NE, 0, 0)) for name, index in OTHER_PID.items())
    ok = ok and all(refuse(name, (1, SCMP_CMP_EQ, command, 0))
                    for name in ("fcntl", "fcntl64") for command in SIGNALLING_FCNTL.values())
    ok = ok and all(refuse("ioctl", (1, SCMP_CMP_EQ, command, 0)) for command in SIGNALLING_IOCTL.values())
    return ok and lib.seccomp_load(ctx) == 0


def main(argv: list[str]) -> None:
    cpu, memory, fsize, parent = (int(x) for x in argv[1:5])
    code_file, args = argv[5], argv[6:]
    die_with_parent(parent)
    first_to_die()
    confine([os.getcwd(), os.path.dirname(os.__file__), "/usr/lib", "/usr/lib64", "/lib", "/lib64",
             "/dev/null", "/dev/zero", "/dev/urandom"])
    if not filtered():
        sys.exit(NO_ISOLATION)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu s, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    with open(code_file, "rb") as source:
        code = compile(source.read(), "<tool>", "exec")
    sys.argv = ["tool", *args]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    globals().clear()  # the code finds none of the launcher's names
    exec(code, namespace)


if __name__ == "__main__":
    main(sys.argv)
