"""A seccomp filter equivalent to Docker's default profile, compiled once per process by libseccomp.

Like Docker's, the filter is an allowlist: every system call it knows and does not name below fails with EPERM.
It allows what ordinary programs use (files, processes, threads, signals, sockets, timers, memory, IPC) and
refuses what a container without CAP_SYS_ADMIN and friends has no business calling: mount and the new mount API,
namespaces (`unshare`, `setns`, `clone` with namespace flags), keyrings, kernel modules, BPF, perf events,
`reboot`, `swapon`, clock setting, `open_by_handle_at`, `userfaultfd`, `kexec_*`, `acct`, `quotactl`, ... As in
Docker, `socket` refuses AF_VSOCK, `personality` accepts only the harmless personas, and `clone3` answers ENOSYS
(its flags live in memory a filter cannot read), so the C library falls back to `clone`, whose flags it can.
Stricter than Docker: io_uring is refused (a frequent source of kernel escapes; programs fall back to
ordinary I/O).

System calls newer than the profile answer ENOSYS, as a kernel without them would, and as runc does for
Docker: a C library tries a new call first and falls back to the old one only on ENOSYS (glibc 2.39's
`fchmodat(..., AT_SYMLINK_NOFOLLOW)` tries `fchmodat2`, later ones the `*xattrat` calls), so EPERM there would
break programs of a newer image than the profile. "Newer" is a number above the newest call the filter allows on
that architecture (`_enosys_above`, a few BPF instructions put before libseccomp's program); below it, a call
not allowed is one the profile knows and refuses: EPERM.

libseccomp does the compiling (it knows every architecture's system call numbers, and adds the 32-bit ABIs
of the machine, x86 and x32 on x86-64 as Docker does, so a 32-bit binary is filtered too, not let through).
Its Python bindings come from Debian's `python3-seccomp` or the pure-Python `pyseccomp` from PyPI, which
wraps the same `libseccomp.so.2`. The program is exported as raw BPF and handed to bubblewrap (`--seccomp
FD`), which loads it right before it starts the shell; nothing here runs inside the sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import os
import struct
import tempfile
from typing import Any

__all__ = ["bpf_program"]

#: Allowed without conditions (names unknown to a machine's architecture or libseccomp version are skipped).
#: Grouped by purpose: files, waiting, memory, processes, identity, signals and time, sockets, IPC, the rest.
#: A call that takes a path is allowed only once both read-set tracers place it (see _reads and _ebpf): the newer
#: ones (`fchmodat2`, the `*xattrat` calls, `file_getattr`, ...) are their hazards and stay out, answering ENOSYS.
_ALLOWED = """
    read write readv writev pread64 pwrite64 preadv preadv2 pwritev pwritev2 lseek _llseek sendfile sendfile64
    copy_file_range splice tee vmsplice readahead fadvise64 fadvise64_64 fallocate truncate truncate64
    ftruncate ftruncate64 fsync fdatasync sync syncfs sync_file_range

    open openat openat2 creat close close_range dup dup2 dup3 fcntl fcntl64 flock ioctl pipe pipe2
    stat stat64 lstat lstat64 fstat fstat64 fstatat64 newfstatat statx statfs statfs64 fstatfs fstatfs64
    access faccessat faccessat2 getdents getdents64 getcwd chdir fchdir mkdir mkdirat rmdir rename renameat
    renameat2 link linkat symlink symlinkat unlink unlinkat readlink readlinkat mknod mknodat
    chmod fchmod fchmodat chown chown32 fchown fchown32 fchownat lchown lchown32 umask
    utime utimes utimensat utimensat_time64 futimesat
    getxattr lgetxattr fgetxattr setxattr lsetxattr fsetxattr listxattr llistxattr flistxattr removexattr
    lremovexattr fremovexattr name_to_handle_at
    inotify_init inotify_init1 inotify_add_watch inotify_rm_watch fanotify_mark

    select _newselect pselect6 pselect6_time64 poll ppoll ppoll_time64 epoll_create epoll_create1 epoll_ctl
    epoll_ctl_old epoll_wait epoll_wait_old epoll_pwait epoll_pwait2 eventfd eventfd2 signalfd signalfd4
    timerfd_create timerfd_settime timerfd_settime64 timerfd_gettime timerfd_gettime64
    io_setup io_destroy io_submit io_cancel io_getevents io_pgetevents io_pgetevents_time64

    brk mmap mmap2 munmap mremap mprotect madvise mincore msync mlock mlock2 mlockall munlock munlockall
    remap_file_pages membarrier memfd_create memfd_secret pkey_alloc pkey_free pkey_mprotect

    execve execveat fork vfork exit exit_group wait4 waitid waitpid kill tkill tgkill getpid getppid gettid
    getpgid setpgid getpgrp getsid setsid set_tid_address get_robust_list set_robust_list rseq futex
    futex_time64 futex_waitv restart_syscall prctl arch_prctl modify_ldt get_thread_area set_thread_area
    set_tls cacheflush breakpoint pidfd_open pidfd_send_signal process_mrelease ptrace process_vm_readv
    process_vm_writev capget capset seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self

    getuid getuid32 geteuid geteuid32 getgid getgid32 getegid getegid32 getresuid getresuid32 getresgid
    getresgid32 getgroups getgroups32 setuid setuid32 setgid setgid32 setreuid setreuid32 setregid setregid32
    setresuid setresuid32 setresgid setresgid32 setfsuid setfsuid32 setfsgid setfsgid32 setgroups setgroups32

    rt_sigaction rt_sigprocmask rt_sigpending rt_sigsuspend rt_sigtimedwait rt_sigtimedwait_time64
    rt_sigqueueinfo rt_tgsigqueueinfo rt_sigreturn sigreturn sigaltstack sigprocmask pause alarm
    getitimer setitimer timer_create timer_delete timer_settime timer_settime64 timer_gettime
    timer_gettime64 timer_getoverrun nanosleep clock_nanosleep clock_nanosleep_time64 clock_gettime
    clock_gettime64 clock_getres clock_getres_time64 gettimeofday time times adjtimex clock_adjtime
    clock_adjtime64

    socketpair bind connect listen accept accept4 getsockname getpeername send sendto sendmsg sendmmsg recv
    recvfrom recvmsg recvmmsg recvmmsg_time64 shutdown getsockopt setsockopt socketcall

    ipc shmget shmat shmdt shmctl semget semop semtimedop semtimedop_time64 semctl msgget msgsnd msgrcv msgctl
    mq_open mq_unlink mq_timedsend mq_timedsend_time64 mq_timedreceive mq_timedreceive_time64 mq_notify
    mq_getsetattr

    uname sysinfo getrlimit ugetrlimit setrlimit prlimit64 getrusage getpriority setpriority getcpu getrandom
    sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_setparam sched_getscheduler
    sched_setscheduler sched_getattr sched_setattr sched_get_priority_max sched_get_priority_min
    sched_rr_get_interval sched_rr_get_interval_time64 ioprio_get ioprio_set
    arm_fadvise64_64 arm_sync_file_range sync_file_range2 riscv_flush_icache
""".split()  # noqa: SIM905 - a readable block of names, grouped

_AF_VSOCK = 40
#: personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26, UNAME26|PER_LINUX32, and the query.
_PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
#: The namespace flags of clone(2): CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACES = 0x7E020000

#: Calls numbered apart from an architecture's table: ARM's private ones (`cacheflush`, `set_tls` from 0x0f0000)
#: and x32's (bit 30 set, under x86-64's arch value). Left to libseccomp's program, like everything it knows.
_PRIVATE_NUMBERS = 0x0F0000
#: Classic BPF (linux/filter.h, linux/seccomp.h): the instructions used, where seccomp_data holds the call's
#: number and architecture, and the action that makes a call fail with an errno.
_LD_ABS, _JA, _JEQ, _JGT, _JGE, _RET = 0x20, 0x05, 0x15, 0x25, 0x35, 0x06
_NR_OFFSET, _ARCH_OFFSET = 0, 4
_RET_ERRNO = 0x00050000


def _bindings() -> Any:
    """libseccomp's own bindings if installed (Debian's python3-seccomp), else pyseccomp, with the same API."""
    try:
        return importlib.import_module("seccomp")
    except ImportError:
        return importlib.import_module("pyseccomp")


def _compile() -> bytes:
    sc = _bindings()
    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    native = sc.system_arch()
    arches = [native]  # those whose calls newer than the profile answer ENOSYS (x32's come under x86-64's)
    for sub in {sc.Arch.X86_64: (sc.Arch.X86, sc.Arch.X32), sc.Arch.AARCH64: (sc.Arch.ARM,)}.get(native, ()):
        # A libseccomp without that ABI: its system calls are refused outright (a wrong architecture kills).
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            f.add_arch(sub)
            arches += [] if sub == sc.Arch.X32 else [sub]

    def allow(name: str, *conditions: Any) -> None:
        # A name unknown to this libseccomp or architecture stays refused, as any name not listed.
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            f.add_rule(sc.ALLOW, name, *conditions)

    for name in _ALLOWED:
        allow(name)
    allow("socket", sc.Arg(0, sc.NE, _AF_VSOCK))
    for persona in _PERSONAS:
        allow("personality", sc.Arg(0, sc.EQ, persona))
    # s390 passes clone's flags second; everywhere else first.
    flags_arg = 1 if native in (getattr(sc.Arch, "S390", None), getattr(sc.Arch, "S390X", None)) else 0
    allow("clone", sc.Arg(flags_arg, sc.MASKED_EQ, _CLONE_NAMESPACES, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return _enosys_above(_newest_allowed(sc, arches)) + out.read()


def _newest_allowed(sc: Any, arches: list[int]) -> dict[int, int]:
    """Per architecture (seccomp's arch value), the highest number of a call the filter allows."""
    names = [*_ALLOWED, "socket", "personality", "clone"]
    newest: dict[int, int] = {}
    for arch in arches:
        # Unknown names resolve to negative numbers, libseccomp's pseudo calls too.
        numbers = [n for n in (sc.resolve_syscall(arch, name) for name in names) if 0 <= n < _PRIVATE_NUMBERS]
        if numbers:
            newest[arch] = max(numbers)
    return newest


def _enosys_above(newest: dict[int, int]) -> bytes:
    """BPF instructions to put before libseccomp's program: a call of architecture `arch` numbered above
    `newest[arch]` (and below the private numbers) fails with ENOSYS; anything else goes on to the program."""
    program = 5 * len(newest) + 2  # where libseccomp's program starts (a jump by j from p lands at p + 1 + j)
    code: list[tuple[int, int, int, int]] = []
    for i, (arch, number) in enumerate(newest.items()):
        at = 5 * i
        code += [
            (_LD_ABS, 0, 0, _ARCH_OFFSET),
            (_JEQ, 0, 3, arch),  # another architecture: the next check
            (_LD_ABS, 0, 0, _NR_OFFSET),
            (_JGT, 0, program - at - 4, number),
            (_JGE, program - at - 5, program - at - 6, _PRIVATE_NUMBERS),  # private: the program; else ENOSYS
        ]
    code += [(_JA, 0, 0, 1), (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in code)


@functools.cache
def bpf_program() -> tuple[int | None, str]:
    """A memfd holding the compiled filter, and "" -- or None and why the machine cannot have one.

    Each command gets its own descriptor of it (`os.open("/proc/self/fd/N")`), which bubblewrap reads to the end.
    """
    try:
        program = _compile()
    except ImportError:
        return None, "no libseccomp bindings (pip install pyseccomp, or apt-get install python3-seccomp)"
    except OSError as exc:
        return None, f"libseccomp is not usable: {exc} (apt-get install libseccomp2)"
    fd = os.memfd_create("tvcache-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    return fd, ""
