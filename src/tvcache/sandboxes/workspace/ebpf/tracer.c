// SPDX-License-Identifier: Apache-2.0
// The user side of the read-set tracer (see _ebpf.py): loads reads.bpf.o, attaches it, and copies its records to
// stdout, each as a 4-byte little-endian length and the record, as many at once as the ring buffer holds.
//
// usage: tracer OBJECT PID TAG RING_BYTES   (PID and TAG: the marker calls', see _ebpf.py)

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static int quiet(enum libbpf_print_level level, const char *format, va_list args)
{
	if (level != LIBBPF_WARN)
		return 0;
	return vfprintf(stderr, format, args);
}

static int copy(void *ctx, void *data, size_t size)
{
	(void)ctx;
	uint32_t n = (uint32_t)size;
	if (fwrite(&n, sizeof(n), 1, stdout) != 1 || fwrite(data, 1, size, stdout) != size)
		return -EPIPE;
	return 0;
}

static int fail(const char *what, long err)
{
	fprintf(stderr, "%s: %s\n", what, strerror(err < 0 ? (int)-err : (int)err));
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 5) {
		fprintf(stderr, "usage: %s OBJECT PID TAG RING_BYTES\n", argv[0]);
		return 2;
	}
	libbpf_set_print(quiet);
	struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
	long err = libbpf_get_error(obj);
	if (err)
		return fail("open the eBPF object", err);
	struct bpf_map *events = bpf_object__find_map_by_name(obj, "events");
	struct bpf_map *state = bpf_object__find_map_by_name(obj, "state");
	if (!events || !state)
		return fail("find the eBPF maps", ENOENT);
	if ((err = bpf_map__set_max_entries(events, (uint32_t)strtoul(argv[4], NULL, 10))))
		return fail("size the ring buffer", err);
	if ((err = bpf_object__load(obj)))
		return fail("load the eBPF programs", err);
	uint32_t key = 0;
	uint64_t config = strtoull(argv[2], NULL, 10) | strtoull(argv[3], NULL, 10) << 32;
	if ((err = bpf_map_update_elem(bpf_map__fd(state), &key, &config, BPF_ANY)))
		return fail("configure the markers", errno);
	struct bpf_program *prog;
	bpf_object__for_each_program(prog, obj)
	{
		if ((err = libbpf_get_error(bpf_program__attach(prog))))
			return fail("attach the eBPF programs", err);
	}
	struct ring_buffer *rb = ring_buffer__new(bpf_map__fd(events), copy, NULL, NULL);
	if (!rb)
		return fail("read the ring buffer", errno);
	static char out[1 << 20];
	setvbuf(stdout, out, _IOFBF, sizeof(out));
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	// The reader waits for this line before it watches anything: from here on, every watched call is seen.
	fputs("READY\n", stdout);
	fflush(stdout);
	while (!stop) {
		// Woken by a marker record, or when the buffer fills up; else every 20 ms it takes what came (a long
		// command's records, and a read stopped at a record another CPU had reserved but not yet written).
		int n = ring_buffer__poll(rb, 20);
		if (n == 0)
			n = ring_buffer__consume(rb);
		if (n == -EINTR)
			continue;
		if (n < 0 || fflush(stdout) != 0)
			break;
	}
	ring_buffer__free(rb);
	bpf_object__close(obj); // detaches the programs
	return 0;
}
