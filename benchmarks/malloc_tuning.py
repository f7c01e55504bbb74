"""An experiment, not a library setting: keep freed memory in glibc's heap.

With glibc's defaults, each training step frees its activation caches (~50 MB for
the default model), glibc trims the top of the heap (or unmaps the large
chunks) back to the OS, and the next step page-faults all of it in again: about
15,000 minor faults per step. Pinning both thresholds stops that. They must be set
together: setting either one by mallopt turns off glibc's dynamic adjustment of both.
The environment does the same before start-up:
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # from glibc's <malloc.h>


def keep_freed_memory() -> bool:
    """True if glibc accepted both settings (False elsewhere, e.g. musl or macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError, TypeError):
        return False
