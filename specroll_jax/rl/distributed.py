"""Multi-process runs through JAX's own multi-controller runtime (`jax.distributed`).

Every process runs the same program on the same global mesh (model/mesh.py). What a
process decides on its own (a timing, a capacity measurement) must become everyone's
decision before it shapes a compiled program, or the processes would run different
collectives and hang: `broadcast` hands process 0's value to all. Files in the workdir
are written by process 0 (`is_primary`); Orbax coordinates its own multi-host writes.
"""
import dataclasses
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from specroll_jax.speculative.tree import TreeConfig


def initialize(coordinator_address: str = '', num_processes: int = 0, process_id: int = -1,
               cluster: bool = False) -> None:
  """Joins the run's processes: from explicit arguments, or (cluster=True) from what JAX
  detects on TPU pods, SLURM and Open MPI. Neither: a single-process run."""
  explicit = bool(coordinator_address)
  if not explicit and not cluster:
    return
  # CPU hosts need a collectives backend across processes; accelerators ignore it.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if explicit:
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f'--num_processes={num_processes} and --process_id={process_id}: '
                       'need num_processes >= 1 and 0 <= process_id < num_processes')
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  else:
    jax.distributed.initialize()


def is_primary() -> bool:
  return jax.process_index() == 0


def broadcast(value):
  """Process 0's `value` (JSON-serialisable) on every process; others may pass None."""
  if jax.process_count() == 1:
    return value
  payload = np.frombuffer(json.dumps(value).encode() if is_primary() else b'', np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size)))
  buffer = np.zeros(size, np.uint8)
  buffer[:payload.size] = payload
  return json.loads(bytes(multihost_utils.broadcast_one_to_all(buffer)).decode())


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def primary_first(name: str, compute):
  """`compute()` on process 0 first (it fills a cache on disk), then on the others (they
  read it): one writer for files such as warm-started heads."""
  result = compute() if is_primary() else None
  barrier(name)
  return result if is_primary() else compute()


def agreed_costs(costs) -> tuple:
  """The speculation gate's prices ((batch, tree step in plain steps), ...) of process 0."""
  return tuple((int(b), float(cost)) for b, cost in broadcast([list(c) for c in costs]))


def agreed_tree_config(make) -> TreeConfig:
  """`make()` (which may measure capacity) on process 0; its TreeConfig on every process."""
  fields = broadcast(dataclasses.asdict(make()) if is_primary() else None)
  fields['capacity_by_batch'] = tuple(tuple(p) for p in fields['capacity_by_batch'])
  return TreeConfig(**fields)
