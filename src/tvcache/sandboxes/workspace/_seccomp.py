"""A seccomp filter equivalent to Docker's default profile, compiled once per process by libseccomp.

Like Docker's, the filter is an allowlist: every system call not named below fails with EPERM. It allows what
ordinary programs use (files, processes, threads, signals, sockets, timers, memory, IPC) and refuses what a
container without CAP_SYS_ADMIN and friends has no business calling: mount and the new mount API, namespaces
(`unshare`, `setns`, `clone` with namespace flags), keyrings, kernel modules, BPF, perf events, `reboot`,
`swapon`, clock setting, `open_by_handle_at`, `userfaultfd`, `kexec_*`, `acct`, `quotactl`, ... As in Docker,
`socket` refuses AF_VSOCK, `personality` accepts only the harmless personas, and `clone3` answers ENOSYS
(its flags live in memory a filter cannot read), so the C library falls back to `clone`, whose flags it can.
Stricter than Docker: io_uring is refused (a frequent source of kernel escapes; programs fall back to
ordinary I/O).

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
import tempfile
from typing import Any

__all__ = ["bpf_program"]

#: Allowed without conditions (names unknown to a machine's architecture or libseccomp version are skipped).
#: Grouped by purpose: files, waiting, memory, processes, identity, signals and time, sockets, IPC, the rest.
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
    for sub in {sc.Arch.X86_64: (sc.Arch.X86, sc.Arch.X32), sc.Arch.AARCH64: (sc.Arch.ARM,)}.get(native, ()):
        # A libseccomp without that ABI: its system calls are refused outright (a wrong architecture kills).
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            f.add_arch(sub)

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
        return out.read()


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
