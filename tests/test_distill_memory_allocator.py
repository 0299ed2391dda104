"""glibc's malloc told to return freed memory (``gdnprune.distill.host_allocator``), measured in child processes.

The setting holds for a whole process, so each case runs in a fresh interpreter that loads only that module
(no torch) and then does what FSDP2 does to glibc: a large block freed (glibc's mmap threshold rises to its
size), then many blocks of a gathered layer's size allocated, touched and freed. The reference is the
process's resident memory (``/proc/self/statm``) before and after those frees, read by the child itself:
without the setting glibc keeps the freed blocks (the case that shows the measurement can fail), with it
they go back to the system, and a ``MALLOC_*`` variable of the user's wins over it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gdnprune.distill.host_allocator as host_allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")

MIB = 1 << 20
CHILD = """
import ctypes, importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("host_allocator", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
applied = module.return_freed_memory() if sys.argv[2] == "set" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

big = libc.malloc(16 << 20)  # mapped (over 128 KiB); freeing it raises glibc's threshold to 16 MiB
ctypes.memset(big, 1, 16 << 20)
libc.free(big)
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
held = resident()
for block in blocks[:-1]:  # the last one stays: the freed blocks are not at the top of the heap
    libc.free(block)
print(json.dumps({"applied": applied, "returned": held - resident()}))
"""


def child(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(host_allocator.__file__)), mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_freed_blocks_go_back_to_the_system_once_set_and_stay_with_glibcs_default():
    default, tuned = child("default"), child("set")
    assert default["returned"] < 8 * MIB  # glibc keeps the 63 freed MiB: what the setting is for
    assert tuned["applied"] is True
    assert tuned["returned"] > 56 * MIB  # 63 MiB freed, each block unmapped


def test_a_malloc_variable_of_the_user_wins():
    kept = child("set", MALLOC_MMAP_THRESHOLD_=str(16 * MIB))
    assert kept["applied"] is False
    assert (
        kept["returned"] < 8 * MIB
    )  # the user's threshold (16 MiB) holds: the 1 MiB blocks stay in the heap


def test_which_user_settings_are_recognised():
    assert host_allocator.user_malloc_setting({"PATH": "/bin"}) is None
    assert host_allocator.user_malloc_setting({"MALLOC_ARENA_MAX": "2"}) == "MALLOC_ARENA_MAX"
    assert host_allocator.user_malloc_setting({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == (
        "GLIBC_TUNABLES"
    )
    assert host_allocator.user_malloc_setting({"GLIBC_TUNABLES": "glibc.rtld.nns=4"}) is None
    with pytest.raises(ValueError, match="positive threshold"):
        host_allocator.return_freed_memory(0)
