"""keep_freed_memory: a step's large tensors come from the heap and stay there once freed.

Checked structurally, in a fresh interpreter with and without the setting (mallopt is process-wide, so never in
this one): where glibc puts a 20 MiB block, and whether the heap keeps its pages after the block is freed. With
glibc's defaults a fresh process maps such a block on its own (and unmaps it on free), so every step that
allocates it faults its pages in again; kept, it lies in the heap and the heap does not shrink. (What that is
worth: docs/benchmarks.md, "Engine", kept memory.)
"""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import ctypes, json, sys
from kvgate.engine.runner.allocator import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return start, end
    return 0, 0

size = 20 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
start, end = heap()
in_heap = start <= block < end
libc.free(block)
start, end = heap()
print(json.dumps({"took": took, "in_heap": in_heap, "heap_after_free": end - start}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_large_blocks_come_from_the_heap_and_it_keeps_them() -> None:
    default, kept = _probe("default"), _probe("keep")
    assert not default["in_heap"]  # mapped on its own: its pages fault in on every allocation
    assert kept["took"] is True and kept["in_heap"]
    assert kept["heap_after_free"] >= 20 << 20  # freed, not trimmed: the next step's block reuses its pages
