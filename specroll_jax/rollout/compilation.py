"""Counts XLA compilations, to prove the steady state compiles nothing new."""
import contextlib

from jax import monitoring

_BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
_counter = {'count': 0}


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  if event == _BACKEND_COMPILE_EVENT:
    _counter['count'] += 1


monitoring.register_event_duration_secs_listener(_on_event)


def compilations_so_far() -> int:
  """XLA compilations in this process since the package was imported."""
  return _counter['count']


@contextlib.contextmanager
def count_compilations():
  """Yields a zero-argument callable returning the compilations since entry."""
  start = compilations_so_far()
  yield lambda: compilations_so_far() - start
