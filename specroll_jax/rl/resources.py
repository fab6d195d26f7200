"""What a run holds in memory, sampled once per GRPO step (the soak's evidence), and the
allocator setting that keeps what it holds close to what it uses."""
import ctypes
import ctypes.util
import os

import jax

# glibc's mallopt parameter for the size from which an allocation is its own mmap.
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION_BYTES = 1 << 20


def return_large_frees_to_the_os() -> bool:
  """Serves every allocation of at least 1 MiB by its own mmap, so freeing it returns it to
  the OS; returns False where the C library has no mallopt (not glibc).

  Why: glibc raises its mmap threshold to the size of each large block freed (up to 32
  MiB), after which such blocks come from its heap arenas and stay resident when freed. A
  GRPO step frees and reallocates gigabytes of XLA buffers (rollout caches, the learner's
  activations): on the SmolLM2 job the resident set sat at 10.3-10.4 GB after each of the
  first 4 steps while live arrays were 1.5 GB; with this, 7.3-7.6 GB, peak 7.9 GB, at the
  same step times and tokens (WORKSPACE_NOTES, issue 31). Setting the threshold also turns
  off glibc's dynamic raising of it, for the whole process.
  """
  path = ctypes.util.find_library('c')
  libc = ctypes.CDLL(path) if path else None
  if libc is None or not hasattr(libc, 'mallopt'):
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))


def _resident_mib() -> float | None:
  """The current resident set (Linux's /proc; None where the platform has no such file)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
  except FileNotFoundError:
    return None


def process_memory() -> dict:
  """Resident set size of this process and JAX's live device buffers, in MiB."""
  arrays = jax.live_arrays()
  return {'rss_mib': _resident_mib(),
          'live_arrays': len(arrays),
          'live_array_mib': sum(a.nbytes for a in arrays) / 2**20}
