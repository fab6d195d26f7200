"""Verification capacity C_hw (METHOD.md section 3), measured once per model and hardware.

C_hw is the number of tokens one target forward can process before its latency rises
markedly above the plain decode step (one token per response). The tree builder gives each
of B_t running responses N_t = clip(C_hw // B_t, 1, N_max) nodes. We time the
verification-shaped forward over a grid of (batch, nodes per row), take the knee per batch
and combine the batches into one number, cached as JSON keyed by model, hardware and
software. Each latency is a median of repeated runs and keeps its spread: a busy machine
shows as spread, and a profile measured on one is measured again rather than trusted.
"""
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import logging

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.kv_cache import KVCache
from specroll_jax.model.transformer import Transformer

DEFAULT_BATCHES = (64, 32, 16, 8)
CACHE_DIR_ENV = 'SPECROLL_CAPACITY_DIR'
DEFAULT_CACHE_DIR = Path('~/.cache/specroll_jax/capacity')
# The largest median relative spread ((q3 - q1) / median of a shape's repeats) of a profile
# measured on an otherwise idle machine; see notes/history.md for the spreads measured.
MAX_SPREAD = 0.1
MEASURE_ATTEMPTS = 3


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def software_versions() -> str:
  """The compiler stack a latency depends on."""
  return f'jax {jax.__version__}, jaxlib {jaxlib.__version__}'


def host_cpu() -> str:
  """The CPU model and core count: on the CPU backend every machine's device kind is
  'cpu', and a profile measured on other cores (a cache directory copied or shared between
  machines) would size trees for the wrong knee."""
  cpuinfo = Path('/proc/cpuinfo')
  models = ([l.split(':', 1)[1].strip() for l in cpuinfo.read_text().splitlines()
             if l.startswith('model name')] if cpuinfo.is_file() else [])
  return f'{models[0] if models else platform.processor() or platform.machine()} x{os.cpu_count()}'


def profile_key(config: ModelConfig) -> tuple:
  """What a profile is valid for: (config fingerprint, dtype, backend, device kind, host
  CPU, software versions)."""
  return (_digest(dataclasses.asdict(config)), config.dtype, jax.default_backend(),
          jax.devices()[0].device_kind, host_cpu(), software_versions())


def relative_spread(samples) -> float:
  """(q3 - q1) / median of repeated timings: robust to one slow run, not to a busy machine."""
  if len(samples) < 2:
    return 0.0
  q1, median, q3 = statistics.quantiles(samples, n=4, method='inclusive')
  return (q3 - q1) / median


@dataclasses.dataclass(frozen=True)
class CapacityProfile:
  config_fingerprint: str
  dtype: str
  backend: str
  device_kind: str
  host_cpu: str
  software: str
  capacity_tokens: int
  measurements: tuple  # ((batch, nodes, total_tokens, latency_ms, relative_spread), ...)
  knee_factor: float
  cache_length: int
  created: str

  @property
  def key(self) -> tuple:
    return (self.config_fingerprint, self.dtype, self.backend, self.device_kind,
            self.host_cpu, self.software)

  @property
  def spread(self) -> float:
    """The median over shapes of each latency's relative spread."""
    return statistics.median(row[4] for row in self.measurements)

  def busy(self, max_spread: float = MAX_SPREAD) -> bool:
    """The spread says something else ran while this profile was measured."""
    return self.spread > max_spread

  def capacity_by_batch(self) -> tuple:
    """((batch, tokens), ...) ascending: the knee measured at each batch size, for hardware
    whose knee moves with the batch (on a 2-core CPU it grows from 16 tokens at batch 8 to
    128 at batch 64, so one C_hw over-spends at small batches)."""
    return tuple((b, tokens) for b, (tokens, _) in
                 sorted(batch_capacities(self.measurements, self.knee_factor).items()))

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> 'CapacityProfile':
    """Raises ValueError or TypeError when the text is not a complete profile."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
      raise ValueError('not a JSON object')
    missing = sorted({f.name for f in dataclasses.fields(cls)} - raw.keys())
    if missing:
      raise ValueError(f'missing fields {missing}')
    return cls(
        config_fingerprint=str(raw['config_fingerprint']), dtype=str(raw['dtype']),
        backend=str(raw['backend']), device_kind=str(raw['device_kind']),
        host_cpu=str(raw['host_cpu']), software=str(raw['software']),
        capacity_tokens=int(raw['capacity_tokens']),
        measurements=tuple((int(b), int(n), int(t), float(ms), float(spread))
                           for b, n, t, ms, spread in raw['measurements']),
        knee_factor=float(raw['knee_factor']), cache_length=int(raw['cache_length']),
        created=str(raw['created']))


def baselines(measurements) -> dict:
  """Latency (ms) of the one-node-per-row forward of each batch: the decode step."""
  base = {b: ms for b, n, _, ms, *_ in measurements if n == 1}
  missing = sorted({row[0] for row in measurements} - base.keys())
  if missing:
    raise ValueError(f'batches {missing} have no nodes=1 measurement (the baseline)')
  return base


def batch_capacities(measurements, knee_factor: float) -> dict:
  """batch -> (tokens, knee_found) from (batch, nodes, total_tokens, latency_ms, ...) rows.

  A batch's capacity is the largest total before the first node count whose latency exceeds
  knee_factor x its baseline; the first crossing is the knee, so a later noisy dip under the
  threshold does not move it. A batch that never crosses only bounds its capacity from below
  (knee_found False, tokens = the largest total measured flat). Never below one node per row.
  """
  if knee_factor <= 1:
    raise ValueError(f'knee_factor must be > 1, got {knee_factor}')
  base = baselines(measurements)
  out = {}
  for batch in sorted(base):
    rows = sorted(row for row in measurements if row[0] == batch)
    crossing = next((i for i, (_, _, _, ms, *_) in enumerate(rows)
                     if ms > knee_factor * base[batch]), None)
    if crossing is None:
      out[batch] = (rows[-1][2], False)
    else:
      out[batch] = (max(rows[crossing - 1][2], batch), True)  # the baseline never exceeds itself
  return out


def pick_capacity(measurements, knee_factor: float) -> int:
  """One C_hw (tokens) for all batch sizes: the lower median of the per-batch capacities.

  The median, not the min: the per-batch knees estimate one hardware limit, and one noisy
  sweep should not set it. A lower bound is unknown above its value, so it sorts above every
  knee. If the median is a lower bound, most batches stayed flat over the whole sweep:
  C_hw is then the largest total measured flat, giving those batches the most nodes tried.
  """
  per_batch = batch_capacities(measurements, knee_factor)
  knees = [tokens for tokens, found in per_batch.values() if found]
  bounds = [tokens for tokens, found in per_batch.values() if not found]
  median = statistics.median_low(sorted(knees) + [math.inf] * len(bounds))
  capacity = max(bounds) if median == math.inf else median
  # At least one node per row at the largest batch: N_t = C_hw // B_t >= 1.
  return int(max(capacity, max(per_batch)))


@partial(jax.jit, static_argnums=(0, 1))
def _verify(config: ModelConfig, projected: int, params, tokens, positions, block_mask,
            cache):
  """The verification step's forward: all nodes through the model, a few to logits."""
  model = Transformer(config)
  hidden, block = model.apply({'params': params}, tokens, positions, block_mask, cache)
  logits = model.apply({'params': params}, hidden[:, :projected], method=Transformer.project)
  # The block KV is returned because the engine commits the accepted path from it.
  return logits, block


def node_counts(max_nodes: int) -> list[int]:
  counts = [1]
  while counts[-1] * 2 <= max_nodes:
    counts.append(counts[-1] * 2)
  return counts if counts[-1] == max_nodes else counts + [max_nodes]


def measure_capacity(config: ModelConfig, params, *, batches=DEFAULT_BATCHES,
                     max_nodes: int = 64, cache_length: int = 256, projected_nodes: int = 5,
                     knee_factor: float = 1.3, repeats: int = 5) -> CapacityProfile:
  """Times the verification forward for each batch x nodes in 1, 2, 4, ... max_nodes.

  Each row attends to a cache half full of `cache_length` slots and projects
  `projected_nodes` hidden states to logits (H + 1 with the default H = 4 heads: at most one
  accepted path). One compilation per (batch, nodes); latency = median of `repeats` runs,
  kept with their relative spread.
  """
  if not batches or min(batches) < 1 or max_nodes < 1 or repeats < 1:
    raise ValueError(f'need batches >= 1, max_nodes >= 1, repeats >= 1; got batches={batches}, '
                     f'max_nodes={max_nodes}, repeats={repeats}')
  if knee_factor <= 1:
    raise ValueError(f'knee_factor must be > 1, got {knee_factor}')  # before, not after, timing
  rng = np.random.default_rng(0)
  prefix = cache_length // 2
  rows = []
  for batch in batches:
    cache = KVCache.zeros(config, batch, cache_length)
    cache = cache.replace(lengths=jnp.full((batch,), prefix, jnp.int32))
    calls = {}
    for nodes in node_counts(max_nodes):
      # XLA's dense attention costs the same under any mask, so a chain stands in for a tree.
      # Inputs are built in numpy: eager jnp ops would each compile once per shape too.
      tokens, positions, mask = jax.device_put((
          rng.integers(0, config.vocab_size, (batch, nodes), dtype=np.int32),
          np.broadcast_to(prefix + np.arange(nodes, dtype=np.int32), (batch, nodes)),
          np.broadcast_to(np.tril(np.ones((nodes, nodes), bool)), (batch, nodes, nodes))))
      calls[nodes] = partial(_verify, config, min(nodes, projected_nodes), params, tokens,
                             positions, mask, cache)
      jax.block_until_ready(calls[nodes]())  # compile and warm up
    times = {nodes: [] for nodes in calls}
    # Node counts interleave within each repeat so drift in background load hits all alike.
    for _ in range(repeats):
      for nodes, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        times[nodes].append(time.perf_counter() - start)
    for nodes, samples in times.items():
      latency_ms, spread = 1000 * statistics.median(samples), relative_spread(samples)
      rows.append((batch, nodes, batch * nodes, latency_ms, spread))
      logging.info('capacity: batch %d, nodes %d: %.3f ms (spread %.3f)', batch, nodes,
                   latency_ms, spread)
  fingerprint, dtype, backend, device_kind, cpu, software = profile_key(config)
  return CapacityProfile(
      config_fingerprint=fingerprint, dtype=dtype, backend=backend, device_kind=device_kind,
      host_cpu=cpu, software=software, capacity_tokens=pick_capacity(rows, knee_factor),
      measurements=tuple(rows),
      knee_factor=knee_factor, cache_length=cache_length,
      created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'))


def profile_path(key: tuple, cache_dir=None) -> Path:
  """<cache_dir>/<hash of the whole key>.json: one file per model x hardware, so hosts of
  different kinds sharing a cache directory do not overwrite each other's profile."""
  directory = cache_dir or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
  return Path(directory).expanduser() / f'{_digest(key)}.json'


def save_profile(profile: CapacityProfile, cache_dir=None) -> Path:
  path = profile_path(profile.key, cache_dir)
  path.parent.mkdir(parents=True, exist_ok=True)
  # A reader never sees a half-written profile; the pid keeps concurrent writers apart.
  tmp = path.with_name(f'{path.name}.{os.getpid()}.tmp')
  tmp.write_text(profile.to_json())
  tmp.replace(path)
  return path


def load_or_measure(config: ModelConfig, params, cache_dir=None, max_spread: float = MAX_SPREAD,
                    attempts: int = MEASURE_ATTEMPTS, **measure_kwargs) -> CapacityProfile:
  """The cached profile for this model and hardware, else a fresh (and cached) measurement.

  A cached profile whose spread says the machine was busy is measured again; a measurement
  that is itself busy is repeated up to `attempts` times, and the steadiest one is kept
  (with a warning if even that one is busy, so the next load measures again).
  cache_dir defaults to $SPECROLL_CAPACITY_DIR, then ~/.cache/specroll_jax/capacity.
  """
  key = profile_key(config)
  path = profile_path(key, cache_dir)
  if path.exists():
    try:
      profile = CapacityProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as e:
      logging.warning('%s: unusable capacity profile (%s); measuring again', path, e)
    else:
      if profile.key != key:
        logging.warning('%s: capacity profile is for %s, not %s; measuring again', path,
                        profile.key, key)
      elif profile.busy(max_spread):
        logging.warning('%s: capacity profile has spread %.3f > %.3f (measured on a busy '
                        'machine); measuring again', path, profile.spread, max_spread)
      else:
        return profile
  measured = []
  for attempt in range(1, attempts + 1):
    measured.append(measure_capacity(config, params, **measure_kwargs))
    if not measured[-1].busy(max_spread):
      break
    logging.warning('capacity measurement %d of %d has spread %.3f > %.3f: the machine is '
                    'busy', attempt, attempts, measured[-1].spread, max_spread)
  profile = min(measured, key=lambda p: p.spread)
  if profile.busy(max_spread):
    logging.warning('%s: keeping the steadiest of %d busy capacity measurements (spread '
                    '%.3f); it will be measured again when next loaded', path, attempts,
                    profile.spread)
  save_profile(profile, cache_dir)
  return profile
