"""Imported only in the fork server, last in its preload list (minidist.core._supervisor):
makes the server, torch loaded, cheap to fork from and quick to leave.

Cheap to fork: forking copies a page-table entry for every 4 KiB page of the server's private
memory, about 56,000 for the 220 MiB that importing torch leaves on its heap, and a rank's exit
frees them again; a 4-rank launch spent about 0.1 s of CPU in the kernel doing so. Collapsed
into 2 MiB pages (MADV_COLLAPSE, Linux 6.1 and later), that memory takes one entry per 2 MiB:
the kernel's share of a launch falls by about 40%, which on a 2-core laptop is CPU the ranks
get. A rank that writes to such a page copies only the 4 KiB it writes, as before. Where the
kernel does not collapse (older kernels, transparent huge pages turned off) nothing changes.

Warm: what a check compares copies of the library's functions with is worked out here once
(`refusal.prepare`), not again in every rank that refuses them.

Quick to leave: once the process that started it is gone, the fork server would spend seconds
tearing down torch's modules (about 5 s on a busy laptop) while looking like a leftover rank;
it has no state worth finalizing, so it exits at once. atexit runs the last registered first,
so this runs before torch's own handlers. Ranks never reach it: they leave with os._exit.
"""

import atexit
import ctypes
import os
import sys

from minidist.core.refusal import prepare

MADV_COLLAPSE = 25  # <linux/mman.h>
HUGE_PAGE = 2 << 20


def collapse_private_memory_into_huge_pages() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as maps:
        for line in maps:
            # address perms offset device inode [name]: the heap and unnamed private memory
            fields = line.split()
            if fields[1] != "rw-p" or fields[5:] not in ([], ["[heap]"]):
                continue
            low, high = (int(address, 16) for address in fields[0].split("-"))
            low = -(-low // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the mapping
            high = high // HUGE_PAGE * HUGE_PAGE
            if high > low:
                libc.madvise(low, high - low, MADV_COLLAPSE)  # a refusal leaves it as it was


prepare(module for name, module in list(sys.modules.items())
        if name.startswith("minidist.") and module is not None)
if sys.platform == "linux":
    collapse_private_memory_into_huge_pages()
atexit.register(os._exit, 0)
