// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
// The kernel side of the read-set tracer (see _ebpf.py): two programs on the raw system call tracepoints, for every
// thread of every process, that act only for the processes of the cgroups in `watched` (a command's sandbox group,
// from the command's start to its end). For each traced call they put one record in one ring buffer shared by all
// CPUs, without waking the reader: after a command, the command's own thread reads the buffer, and a thread is woken
// only when the buffer fills up. Waking a reader for every record (one interrupt each, 10-13 us in a VM) was most of
// bpftrace's cost.
//
// calls.h, written by _ebpf.py, says which system calls are traced and where their arguments are.

#include <linux/bpf.h>
#include <linux/types.h>
#include <asm/unistd.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

// The kernel's types, as much of them as is read here: libbpf finds each field in the running kernel's BTF.
struct vfsmount;
struct dentry;
struct path {
	struct vfsmount *mnt;
	struct dentry *dentry;
} __attribute__((preserve_access_index));
struct fs_struct {
	struct path root, pwd;
} __attribute__((preserve_access_index));
struct file {
	struct path f_path;
} __attribute__((preserve_access_index));
struct fdtable {
	unsigned int max_fds;
	struct file **fd;
} __attribute__((preserve_access_index));
struct files_struct {
	struct fdtable *fdt;
} __attribute__((preserve_access_index));
struct thread_info {
	__u32 status;
} __attribute__((preserve_access_index));
struct task_struct {
	struct thread_info thread_info;
	struct fs_struct *fs;
	struct files_struct *files;
} __attribute__((preserve_access_index));
struct pt_regs {
	unsigned long di, si, dx, r10, r8, r9, orig_ax;
} __attribute__((preserve_access_index));

#define TS_COMPAT 0x0002 // x86: the thread is in a 32-bit system call (int 0x80, sysenter), numbered otherwise
#define X32_SYSCALL_BIT 0x40000000
#define AT_FDCWD -100
#define AT_EMPTY_PATH 0x1000
#define PATH_MAX 4096

// How a call is traced (struct call's kind).
enum { PATH_CALL = 1, FD_CALL, HAZARD, CONNECT, EXECVE, SEND };
// What a call made that later relative paths start from (struct call's made).
enum { MADE_FD = 1, MADE_PWD };
// What a record is (struct record's kind); the marker calls' ops (see _ebpf.py).
enum { EVENT = 'E', RISK = 'H', SOCKET = 'C', UNWATCHED = 'U', SYNCED = 'Y' };
enum { WATCH = 1, UNWATCH = 2, SYNC = 3 };

struct call {
	__u8 kind, made, fstat;
	__s8 dfd, path, flags; // argument positions, -1: none
	__u16 index;           // the call's place in _ebpf.py's list of names
};

#include "calls.h"

// One record; _ebpf.py reads the same layout (_HEAD). Identities are (mount, dentry) addresses.
struct record {
	__u64 ns, cgroup;
	__s64 result, dirfd, flags; // U: result is "was watched", flags the losses; Y: result the token
	__u64 base[2], made[2], root[2];
	__u32 tid;
	__u16 call;
	__u8 kind, pad;
	char path[PATH_MAX];
};
#define HEAD (sizeof(struct record) - PATH_MAX)

// The marker calls' process and tag. The process is named by its PID namespace (the device and inode of its
// /proc/self/ns/pid) and its pid there: in a container, tvcache's pid is its namespace's, not the machine's.
struct config {
	__u64 dev, ino;
	__u32 pid, tag;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 25); // set by the loader
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u8);
} watched SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct record);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1); // records lost so far
	__type(key, __u32);
	__type(value, __u64);
} lost SEC(".maps");

// Every process's every system call runs these programs, so the common case, a process not watched, must be cheap:
// a count of watched groups by the low bits of their ids, in plain memory, answers most of them without a map
// lookup (at 8061617's bpftrace, only the traced calls ran a program; measured in docs/reads.md). A count is raised
// before the group's command starts and lowered after it ended, only when the map gained or lost the group.
#define SLOTS (1 << 14)
__u32 watching[SLOTS];
__u32 watching_any; // the sum of the counts: while no command is watched, not even the cgroup id is asked

static int is_watched(void)
{
	if (!watching_any)
		return 0;
	__u64 cgroup = bpf_get_current_cgroup_id();
	return watching[cgroup & (SLOTS - 1)] && bpf_map_lookup_elem(&watched, &cgroup);
}

static __u64 *losses(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&lost, &zero);
}

static void lose(void)
{
	__u64 *count = losses();
	if (count)
		__sync_fetch_and_add(count, 1);
}

static struct record *blank(char kind)
{
	__u32 zero = 0;
	struct record *r = bpf_map_lookup_elem(&scratch, &zero);
	if (!r)
		return 0;
	__builtin_memset(r, 0, HEAD);
	__u64 id = bpf_get_current_pid_tgid();
	r->ns = bpf_ktime_get_ns();
	r->tid = (__u32)id;
	r->cgroup = bpf_get_current_cgroup_id();
	r->kind = kind;
	return r;
}

// Put `r` with `len` bytes of path in the buffer, waking the reader only when it falls behind: after a command, the
// command's own thread reads the buffer (see _ebpf.py).
static void emit(struct record *r, long len)
{
	__u64 size = HEAD + (len > 0 ? (__u64)len : 0);
	if (size > sizeof(*r))
		size = sizeof(*r);
	__u64 flags = BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) > bpf_ringbuf_query(&events, BPF_RB_RING_SIZE) / 8)
		flags = BPF_RB_FORCE_WAKEUP;
	if (bpf_ringbuf_output(&events, r, size, flags) < 0)
		lose();
}

static void of_path(struct path *p, __u64 out[2])
{
	out[0] = (__u64)BPF_CORE_READ(p, mnt);
	out[1] = (__u64)BPF_CORE_READ(p, dentry);
}

static void of_fd(struct task_struct *task, long fd, __u64 out[2])
{
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	if (!fdt || fd < 0 || fd >= BPF_CORE_READ(fdt, max_fds))
		return;
	struct file **fds = BPF_CORE_READ(fdt, fd);
	struct file *f = 0;
	bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]);
	if (f) {
		out[0] = (__u64)BPF_CORE_READ(f, f_path.mnt);
		out[1] = (__u64)BPF_CORE_READ(f, f_path.dentry);
	}
}

static void of_pwd(struct task_struct *task, __u64 out[2])
{
	struct fs_struct *fs = BPF_CORE_READ(task, fs);
	if (fs)
		of_path(&fs->pwd, out);
}

static void of_root(struct task_struct *task, __u64 out[2])
{
	struct fs_struct *fs = BPF_CORE_READ(task, fs);
	if (fs)
		of_path(&fs->root, out);
}

static void hazard(__u16 index, long result)
{
	struct record *r = blank(RISK);
	if (!r) {
		lose();
		return;
	}
	r->call = index;
	r->result = result;
	emit(r, 0);
}

static void marker(__u64 op, __u64 value)
{
	__u64 *count = losses();
	__u64 lost_so_far = count ? *count : 0;
	if (op == WATCH) {
		__u8 one = 1;
		// Full: the window's U record says so. Already there (a late unwatch to come): counted already.
		if (bpf_map_update_elem(&watched, &value, &one, BPF_NOEXIST) == 0) {
			__sync_fetch_and_add(&watching[value & (SLOTS - 1)], 1);
			__sync_fetch_and_add(&watching_any, 1);
		}
		return;
	}
	struct record *r = blank(op == UNWATCH ? UNWATCHED : SYNCED);
	if (!r) {
		lose();
		return;
	}
	r->flags = (__s64)lost_so_far;
	if (op == UNWATCH) {
		r->cgroup = value;
		r->result = bpf_map_lookup_elem(&watched, &value) != 0;
		if (bpf_map_delete_elem(&watched, &value) == 0) {
			__sync_fetch_and_add(&watching[value & (SLOTS - 1)], -1);
			__sync_fetch_and_add(&watching_any, -1);
		}
	} else {
		r->result = (__s64)value;
	}
	emit(r, 0);
}

static __u64 arg(struct pt_regs *regs, int k)
{
	switch (k) {
	case 0: return BPF_CORE_READ(regs, di);
	case 1: return BPF_CORE_READ(regs, si);
	case 2: return BPF_CORE_READ(regs, dx);
	case 3: return BPF_CORE_READ(regs, r10);
	case 4: return BPF_CORE_READ(regs, r8);
	default: return BPF_CORE_READ(regs, r9);
	}
}

// Where a call taking a path (and maybe a directory descriptor and flags) starts, from the registers: its directory
// descriptor, flags and the identity of the directory a relative path starts from, in `r`; the path read into `r`.
static long named(struct task_struct *task, struct pt_regs *regs, const struct call *c, struct record *r)
{
	r->dirfd = c->dfd >= 0 ? (int)arg(regs, c->dfd) : AT_FDCWD;
	r->flags = c->flags >= 0 ? (__s64)arg(regs, c->flags) : 0;
	if (r->dirfd == AT_FDCWD)
		of_pwd(task, r->base);
	else
		of_fd(task, r->dirfd, r->base);
	return bpf_probe_read_user_str(r->path, PATH_MAX, (void *)arg(regs, c->path));
}

SEC("raw_tracepoint/sys_enter")
int enter(struct bpf_raw_tracepoint_args *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	long nr = (long)ctx->args[1];
	if (nr == __NR_lseek && (int)arg(regs, 0) == -1) {
		__u32 zero = 0;
		struct config *c = bpf_map_lookup_elem(&config, &zero);
		__u64 whence = arg(regs, 2);
		// The helper fails for a process of any other PID namespace (its pid there may be the same number).
		struct bpf_pidns_info self;
		if (c && (whence >> 2) == c->tag && bpf_get_ns_current_pid_tgid(c->dev, c->ino, &self, sizeof(self)) == 0 &&
		    self.tgid == c->pid)
			marker(whence & 3, arg(regs, 1));
		return 0;
	}
	if (!is_watched())
		return 0;
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	if ((BPF_CORE_READ(task, thread_info.status) & TS_COMPAT) || (nr & X32_SYSCALL_BIT)) {
		hazard(COMPAT_INDEX, 0);
		return 0;
	}
	if (nr < 0 || nr >= CALLS_MAX) {
		hazard(NEWER_INDEX, nr);
		return 0;
	}
	const struct call *c = &CALLS[nr];
	if (c->kind == 0) {
		if (nr > LAST_KNOWN)
			hazard(NEWER_INDEX, nr);
		return 0;
	}
	if (c->kind == HAZARD) {
		hazard(c->index, 0);
		return 0;
	}
	if (c->kind == SEND) {
		// A message sent to an address talks to whatever is there, with no connect: a hazard. One on a connected
		// socket or a pair (no address) is not. `made`: the address is the first field of what `path` points
		// to (sendmsg's msghdr); one that cannot be read counts as given.
		__u64 address = arg(regs, c->path);
		if (c->made && address && bpf_probe_read_user(&address, sizeof(address), (void *)address) < 0)
			address = 1;
		if (address)
			hazard(c->index, 0);
		return 0;
	}
	if (c->kind == EXECVE) {
		// Read on entry: at the exit, the old memory and registers are gone. Its result does not matter here.
		struct record *r = blank(EVENT);
		if (!r) {
			lose();
			return 0;
		}
		r->call = c->index;
		of_root(task, r->root);
		emit(r, named(task, regs, c, r));
	}
	return 0; // any other traced call is recorded at its exit, from the same registers (see leave)
}

SEC("raw_tracepoint/sys_exit")
int leave(struct bpf_raw_tracepoint_args *ctx)
{
	if (!is_watched())
		return 0;
	// The call's number and arguments are still in the registers the process entered the kernel with: only the
	// result is written back (an execve's new registers are not: it is recorded on entry). So nothing is kept from
	// the entry: a map entry per call, put and taken, cost 0.4 of the 3 us a traced stat took in the kernel.
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	long nr = (long)BPF_CORE_READ(regs, orig_ax);
	if (nr < 0 || nr >= CALLS_MAX) // an x32 call, or one newer than the table: a hazard on entry
		return 0;
	const struct call *c = &CALLS[nr];
	if (c->kind != PATH_CALL && c->kind != FD_CALL && c->kind != CONNECT)
		return 0;
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	if (BPF_CORE_READ(task, thread_info.status) & TS_COMPAT) // numbered otherwise: a hazard on entry
		return 0;
	struct record *r = blank(c->kind == CONNECT ? SOCKET : EVENT);
	if (!r) {
		lose();
		return 0;
	}
	long ret = (long)ctx->args[1];
	long len = 0;
	r->call = c->index;
	r->result = ret;
	of_root(task, r->root);
	if (c->kind == CONNECT) {
		// A failed connection to a Unix socket's path probes that path; any other connection is a hazard.
		__u16 family = 0;
		__u64 address = arg(regs, 1);
		bpf_probe_read_user(&family, sizeof(family), (void *)address);
		r->dirfd = family;
		of_pwd(task, r->base);
		len = bpf_probe_read_user_str(r->path, PATH_MAX, (void *)(address + 2));
	} else if (c->kind == FD_CALL) {
		r->dirfd = (int)arg(regs, 0);
		of_fd(task, r->dirfd, r->base);
		if (c->made == MADE_PWD)
			of_pwd(task, r->made);
	} else {
		len = named(task, regs, c, r);
		if (ret >= 0 && c->made == MADE_FD)
			of_fd(task, ret, r->made);
		if (ret >= 0 && c->made == MADE_PWD)
			of_pwd(task, r->made);
		// fstat of an open file (glibc's fstat is newfstatat(fd, "", AT_EMPTY_PATH)): a third of all calls,
		// and the open that made the descriptor is recorded.
		if (c->fstat && (r->flags & AT_EMPTY_PATH) && len == 1)
			return 0;
	}
	emit(r, len);
	return 0;
}

// The kernel lets only GPL-compatible programs read its memory: this file is offered under GPL-2.0 as well.
char LICENSE[] SEC("license") = "GPL";
