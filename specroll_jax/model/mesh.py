"""Device mesh and partition rules: batch over 'data', weights over 'model'."""
import dataclasses
import re

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


# Megatron-style split: column-parallel in-projections, row-parallel out-projections.
PARAM_RULES = (
    (r'.*(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$', P(None, 'model')),
    (r'.*(q_proj|k_proj|v_proj)/bias$', P('model')),
    (r'.*(o_proj|down_proj)/kernel$', P('model', None)),
    (r'.*lm_head/kernel$', P(None, 'model')),
    (r'.*embed_tokens/embedding$', P('model', None)),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Axis sizes; data=-1 takes every device not used by the model axis."""
  data: int = 1
  model: int = 1


def make_mesh(config: MeshConfig = MeshConfig()) -> Mesh:
  devices = jax.devices()
  model = config.model
  data = len(devices) // model if config.data == -1 else config.data
  if data < 1 or data * model > len(devices):
    raise ValueError(f'mesh data={config.data} x model={model} needs more than the '
                     f'{len(devices)} available devices')
  return Mesh(np.array(devices[:data * model]).reshape(data, model), ('data', 'model'))


def data_size(mesh: Mesh) -> int:
  return mesh.shape['data']


def param_sharding(mesh: Mesh, params) -> dict:
  """NamedSharding per parameter from PARAM_RULES; unmatched params are replicated."""
  flat = traverse_util.flatten_dict(params, sep='/')
  out = {}
  for path, value in flat.items():
    spec = next((s for pattern, s in PARAM_RULES if re.fullmatch(pattern, path)), P())
    if any(axis is not None and value.shape[i] % mesh.shape[axis] for i, axis in enumerate(spec)):
      spec = P()  # a dimension the model axis does not divide stays whole
    out[path] = NamedSharding(mesh, spec)
  return traverse_util.unflatten_dict(out, sep='/')


def shard_params(mesh: Mesh, params):
  return jax.device_put(params, param_sharding(mesh, params))


def _row_spec(leaf) -> P:
  return P(*(['data'] + [None] * (leaf.ndim - 1))) if leaf.ndim else P()


def constrain_rows(mesh: Mesh | None, tree):
  """Pins every per-row array of a rollout state (KV cache layers included) to 'data'."""
  if mesh is None:
    return tree
  return jax.tree.map(
      lambda node: jax.lax.with_sharding_constraint(node, NamedSharding(mesh, _row_spec(node))),
      tree)
