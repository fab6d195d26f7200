"""Test setup: 8 host CPU devices (for the sharding tests), one compilation cache for the
session, and shared fixtures."""
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere in the test process. Once: pytest-xdist's
# workers inherit the flags of the process that imported this file first.
HOST_DEVICES_FLAG = '--xla_force_host_platform_device_count=8'
if HOST_DEVICES_FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}".strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# A persistent compilation cache, new for each session (each pytest-xdist worker has its own:
# JAX writes an entry without a lock, so another process could read it half written) and
# inherited by the subprocesses the tests start: a program compiled once (the same HLO,
# options and devices) is loaded by later tests instead of compiled again, the same
# executable and so the same bits (the exactness module ran 28% faster with it, 2026-12-04).
# Loads still count as compilations (rollout/compilation.py), so the no-recompilation tests
# see them.
SESSION_CACHE_DIR = tempfile.mkdtemp(prefix='specroll_tests_xla_cache_')
os.environ['JAX_COMPILATION_CACHE_DIR'] = SESSION_CACHE_DIR
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'

import pytest  # noqa: E402

from specroll_jax.tasks import paths  # noqa: E402

REPO = paths.REPO_DIR
STORIES = paths.STORIES260K_DIR
# The first rows of every dataset file, in a data directory's layout (see its README).
FIXTURE_DATA = REPO / 'tests' / 'fixtures' / 'data'
# Only the tests of the full datasets themselves (row counts, their first rows) need them;
# a clone with nothing beside it has only the fixtures, and CI has the full files.
needs_full_data = pytest.mark.skipif(
    not paths.data_dir_exists(),
    reason=f'the full datasets are not here: set {paths.DATA_DIR_VARIABLE} or place them at '
           f'{paths.DEFAULT_DATA_DIR}')


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'slow: starts processes or runs a notebook (minutes); `pytest -m "not slow"` '
      'is the fast set, CI runs everything')


def pytest_unconfigure():
  """Each process removes the compilation cache it made (~125 MB a worker), which would
  otherwise stay in the temporary folder after every run."""
  shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope='session')
def stories_policy():
  from specroll_jax import load_policy
  return load_policy(STORIES)


@pytest.fixture(autouse=True, scope='module')
def release_compiled_programs():
  """Drops JAX's compiled programs after each test module. Every XLA:CPU executable keeps
  anonymous memory mappings (the kernel allows 65,530): without this a whole-suite process
  crashed in a compile near the end (a segfault in backend_compile_and_load); with it the
  suite passed, peaking at ~42,000 mappings inside test_trainer."""
  yield
  import jax
  jax.clear_caches()
