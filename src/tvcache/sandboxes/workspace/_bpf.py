"""The read-set tracer's kernel side: its eBPF object, built from ebpf/reads.bpf.c with clang, loaded and attached
with libbpf (a handful of its C functions, through ctypes), and its ring buffer, read in this process straight from
the memory the kernel shares with it: taking records is a few loads and no system call, and no other thread or
process needs waking for it. See _ebpf for what the records mean.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import mmap
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["Program", "available", "build"]

_SOURCES = Path(__file__).with_name("ebpf")
#: A record's header in the ring: its length, with these two bits, and the page offset the kernel uses.
_BUSY, _DISCARD, _HEADER = 1 << 31, 1 << 30, 8


def _clang() -> str | None:
    found = shutil.which("clang")
    return found if found is not None and os.path.isfile("/usr/include/bpf/bpf_helpers.h") else None


@functools.cache
def _libbpf() -> ctypes.CDLL | None:
    """libbpf, its functions typed; None if the machine has none. Looked up once: finding it runs `ldconfig`."""
    name = ctypes.util.find_library("bpf")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    for function, result, args in [
        ("libbpf_set_print", p, [p]),
        ("bpf_object__open_file", p, [ctypes.c_char_p, p]),
        ("bpf_object__find_map_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_map__set_max_entries", i, [p, ctypes.c_uint32]),
        ("bpf_object__load", i, [p]),
        ("bpf_map__fd", i, [p]),
        ("bpf_map_update_elem", i, [i, p, p, ctypes.c_uint64]),
        ("bpf_object__next_program", p, [p, p]),
        ("bpf_program__attach", p, [p]),
        ("bpf_link__destroy", i, [p]),
        ("bpf_object__close", None, [p]),
    ]:
        f = getattr(lib, function)
        f.restype, f.argtypes = result, args
    lib.libbpf_set_print(None)  # its messages would go to this process's stderr; failures raise here instead
    return lib


def available(calls_h: str) -> bool:
    """Can the tracer run here? x86-64 (where its table of calls is), the kernel's type information (BTF, for its
    reads of kernel structures), libbpf, and a built object or clang and libbpf's headers to build one."""
    if os.uname().machine != "x86_64" or not os.path.isfile("/sys/kernel/btf/vmlinux"):
        return False
    if _libbpf() is None:
        return False
    return _clang() is not None or _object(calls_h).is_file()


def _object(calls_h: str) -> Path:
    """Where this version's object is, or is to be, built: a name per content of its sources, in the user's cache."""
    digest = hashlib.sha256(calls_h.encode())
    digest.update((_SOURCES / "reads.bpf.c").read_bytes())
    digest.update(os.uname().machine.encode())
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "tvcache" / "ebpf" / f"reads-{digest.hexdigest()[:16]}.bpf.o"


def build(calls_h: str) -> Path:
    """The tracer's eBPF object for the table of calls `calls_h`, built with clang on first use (about a second) and
    kept in the user's cache. Raises OSError if it cannot be built."""
    target = _object(calls_h)
    if target.is_file():
        return target
    clang = _clang()
    if clang is None:
        raise OSError("the eBPF tracer needs clang and libbpf's headers to build (apt-get install clang libbpf-dev)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as work:
        shutil.copy(_SOURCES / "reads.bpf.c", work)
        Path(work, "calls.h").write_text(calls_h)
        include = f"/usr/include/{os.uname().machine}-linux-gnu"
        argv = [clang, "-O2", "-g", "-target", "bpf", f"-I{include}", "-c", "reads.bpf.c", "-o", "reads.bpf.o"]
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"could not build the eBPF tracer: {done.stderr.strip()[-2000:]}")
        os.replace(Path(work, "reads.bpf.o"), target)  # atomic: another process building it wrote the same
    return target


def _failed(what: str, code: int | None = None) -> OSError:
    number = -code if code is not None and code < 0 else ctypes.get_errno()
    return OSError(number, f"the eBPF tracer could not {what}: {os.strerror(number)}")


class Program:
    """The eBPF object at `path` loaded, configured and attached (its programs run from here on, in every process,
    until `close` or this process's end), with `ring` bytes of ring buffer (a power of two). `config` is its map
    `config`'s one value: the marker calls' process and tag (reads.bpf.c's struct config)."""

    def __init__(self, path: Path, *, ring: int, config: bytes):
        lib = _libbpf()
        if lib is None:
            raise OSError("the eBPF tracer needs libbpf (apt-get install libbpf1)")
        self._lib = lib
        self._links: list[int] = []
        self._obj = lib.bpf_object__open_file(os.fsencode(path), None)
        if not self._obj:
            raise _failed("open its object")
        try:
            events = lib.bpf_object__find_map_by_name(self._obj, b"events")
            settings = lib.bpf_object__find_map_by_name(self._obj, b"config")
            if not events or not settings:
                raise OSError(f"the eBPF tracer's object {path} lacks its maps")
            if code := lib.bpf_map__set_max_entries(events, ring):
                raise _failed("size its ring buffer", code)
            if code := lib.bpf_object__load(self._obj):
                raise _failed("load its programs (root, and a kernel with BTF?)", code)
            key, value = ctypes.c_uint32(0), ctypes.create_string_buffer(config, len(config))
            if lib.bpf_map_update_elem(lib.bpf_map__fd(settings), ctypes.byref(key), value, 0):
                raise _failed("configure its markers")
            self.ring = Ring(lib.bpf_map__fd(events), ring)
            program = lib.bpf_object__next_program(self._obj, None)
            while program:
                link = lib.bpf_program__attach(program)
                if not link:
                    raise _failed("attach its programs")
                self._links.append(link)
                program = lib.bpf_object__next_program(self._obj, program)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Detach the programs and free the object (its maps too)."""
        for link in self._links:
            self._lib.bpf_link__destroy(link)
        self._links = []
        if getattr(self, "ring", None) is not None:
            self.ring.close()
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = None


class Ring:
    """A BPF ring buffer read in this process. The kernel shares it as a page with the consumer's position (ours to
    write), a page with the producer's, and the data, mapped twice in a row so that a record that wraps around reads
    as one piece. Not thread-safe: one reader at a time."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        page = mmap.PAGESIZE
        self._consumer = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._producer = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._view: memoryview | None = memoryview(self._producer)
        self._page, self._mask = page, size - 1

    def take(self, handle: Callable[[memoryview], None]) -> None:
        """Hand each record written since the last `take` to `handle` (a view valid only during the call), up to
        the first one another CPU has reserved and not yet written."""
        view = self._view
        assert view is not None
        consumer = int.from_bytes(self._consumer[:8], "little")
        producer = int.from_bytes(view[:8], "little")  # x86: later loads are not taken before this one
        data, mask = view[self._page :], self._mask
        try:
            while consumer < producer:
                at = consumer & mask
                head = int.from_bytes(data[at : at + 4], "little")
                if head & _BUSY:
                    break
                length = head & ~(_BUSY | _DISCARD)
                if not head & _DISCARD:
                    handle(data[at + _HEADER : at + _HEADER + length])
                consumer += (length + _HEADER + 7) & ~7
        finally:
            data.release()
            self._consumer[:8] = consumer.to_bytes(8, "little")  # the kernel may reuse what is behind it

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
            self._producer.close()
            self._consumer.close()
