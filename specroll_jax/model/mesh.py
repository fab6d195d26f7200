"""One device mesh for the whole run: rows over ('data', 'fsdp'), weights over ('fsdp', 'tensor').

FSDP-style: every large parameter (and so its optimizer state, which has its shape) is
split over 'fsdp', and the batch rows of rollouts and learner over 'data' x 'fsdp', so a
forward all-gathers one layer's weights at a time. Megatron-style on 'tensor':
column-parallel in-projections, row-parallel out-projections, the vocabulary split, and
the KV cache split over its KV heads. Rollouts and the learner read the same sharded
arrays: there is no second copy of the policy.

Works unchanged across processes (`jax.distributed`): `jax.devices()` is then every
process's devices, `put_rows` builds a global array from a host array each process holds
in full, and `to_host` gathers a global array back to every process.
"""
import dataclasses
import re

import jax
import numpy as np
import optax
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specroll_jax.model.kv_cache import KVCache

AXES = ('data', 'fsdp', 'tensor')
ROWS = ('data', 'fsdp')  # the axes batch rows are split over

# Flax Dense kernels are [in, out]; the embedding is [V, D].
PARAM_RULES = (
    (r'.*(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$', P('fsdp', 'tensor')),
    (r'.*(q_proj|k_proj|v_proj)/bias$', P('tensor')),
    (r'.*(o_proj|down_proj)/kernel$', P('tensor', 'fsdp')),
    (r'.*lm_head/kernel$', P('fsdp', 'tensor')),
    (r'.*embed_tokens/embedding$', P('tensor', 'fsdp')),
    # LoRA adapters (rl/lora.py) of a kernel [in, out]: a [in, r], b [r, out], each split
    # over 'fsdp' along its long side (r is small; the merged delta takes W's sharding).
    (r'.*/lora_a$', P('fsdp', None)),
    (r'.*/lora_b$', P(None, 'fsdp')),
)
# Horizon heads (speculative/heads.py): w1 [H, D, inner] column-, w2 [H, inner, D] row-parallel.
HEAD_RULES = (
    (r'w1$', P(None, 'fsdp', 'tensor')),
    (r'w2$', P(None, 'tensor', 'fsdp')),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Axis sizes; one of them may be -1: every device the other two leave."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    sizes = (self.data, self.fsdp, self.tensor)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
      raise ValueError(f'config mesh: data={self.data}, fsdp={self.fsdp}, '
                       f'tensor={self.tensor}; each must be >= 1, and at most one -1')
    known = int(np.prod([s for s in sizes if s != -1]))
    if num_devices % known:
      raise ValueError(f'config mesh: data={self.data} x fsdp={self.fsdp} x '
                       f'tensor={self.tensor} does not divide the {num_devices} devices')
    return tuple(num_devices // known if s == -1 else s for s in sizes)


def make_mesh(config: MeshConfig = MeshConfig()) -> Mesh:
  """The mesh over the first data x fsdp x tensor devices, 'tensor' innermost, so tensor
  groups are neighbouring devices (one host's) and rows are split process-major."""
  devices = jax.devices()
  shape = config.shape(len(devices))
  return Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), AXES)


def axis_size(sizes, axis) -> int:
  """Devices along `axis` (a name or a tuple of names) of a mesh shape {name: size}."""
  return int(np.prod([sizes[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


def row_shards(mesh: Mesh | None) -> int:
  """How many pieces batch rows are split into (batch buckets are multiples of it)."""
  return 1 if mesh is None else axis_size(mesh.shape, ROWS)


def _fitted(sizes, spec: P, shape) -> P:
  """`spec` without the axes that do not divide their dimension (that dimension stays whole)."""
  return P(*(axis if axis is None or shape[i] % axis_size(sizes, axis) == 0 else None
             for i, axis in enumerate(spec)))


def rule_specs(sizes, tree, rules) -> dict:
  """PartitionSpec per leaf of `tree` (arrays or shapes) on a mesh of shape `sizes`;
  leaves no rule matches are replicated."""
  flat = traverse_util.flatten_dict(tree, sep='/')
  out = {path: _fitted(sizes, next((s for pattern, s in rules if re.fullmatch(pattern, path)),
                                   P()), value.shape)
         for path, value in flat.items()}
  return traverse_util.unflatten_dict(out, sep='/')


def _rule_sharding(mesh: Mesh, tree, rules) -> dict:
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), rule_specs(mesh.shape, tree, rules),
                      is_leaf=lambda x: isinstance(x, P))


def param_sharding(mesh: Mesh, params) -> dict:
  """NamedSharding per policy parameter (shapes suffice: works on abstract values)."""
  return _rule_sharding(mesh, params, PARAM_RULES)


def head_sharding(mesh: Mesh, head_params) -> dict:
  return _rule_sharding(mesh, head_params, HEAD_RULES)


def optimizer_sharding(mesh: Mesh, optimizer, opt_state, params_sharding):
  """Optimizer state sharded like the parameters it mirrors (Adam's moments); scalars
  such as the step count are replicated."""
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_state,
                               params_sharding, transform_non_params=lambda _: replicated)


def shard_params(mesh: Mesh, params):
  return jax.device_put(params, param_sharding(mesh, params))


def rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, P(*([ROWS] + [None] * (ndim - 1))) if ndim else P())


def cache_layer_spec(sizes, shape) -> P:
  """A KV cache layer ([B, KVH, Dh, S] keys, [B, KVH, S, Dh] values): rows as everywhere,
  KV heads over 'tensor' (the heads a column-parallel k/v projection produces on each
  device)."""
  return _fitted(sizes, P(ROWS, 'tensor', None, None), shape)


def _cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
  layer = lambda x: NamedSharding(mesh, cache_layer_spec(mesh.shape, x.shape))
  return KVCache(k=tuple(map(layer, cache.k)), v=tuple(map(layer, cache.v)),
                 lengths=rows_sharding(mesh, cache.lengths.ndim))


def constrain_rows(mesh: Mesh | None, tree):
  """Pins every per-row array of a rollout state to the row axes (the KV cache's heads
  also to 'tensor')."""
  if mesh is None:
    return tree

  def pin(node):
    if isinstance(node, KVCache):
      return jax.lax.with_sharding_constraint(node, _cache_sharding(mesh, node))
    return jax.lax.with_sharding_constraint(node, rows_sharding(mesh, np.ndim(node)))

  return jax.tree.map(pin, tree, is_leaf=lambda node: isinstance(node, KVCache))


def put_rows(mesh: Mesh | None, array):
  """A host array every process holds in full -> a device array with rows split over the
  row axes (each process transfers only its own devices' rows)."""
  array = np.asarray(array)
  if mesh is None:
    return jax.numpy.asarray(array)
  return jax.make_array_from_callback(array.shape, rows_sharding(mesh, array.ndim),
                                      lambda index: array[index])


def to_host(tree):
  """numpy copies of (possibly multi-process) device arrays, the same on every process."""
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(fetch, tree)
