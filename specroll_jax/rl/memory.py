"""Memory per device of a GRPO run on a mesh, before anything is allocated.

Parameters, adapters, gradients and optimizer state are exact: their shapes come from the
model config (`jax.eval_shape`, no weights) and their per-device pieces from the same
partition rules the run applies (model/mesh.py). The KV cache is exact for the largest
rollout bucket. Learner activations are an estimate: what one micro-batch keeps for the
backward pass (per layer the block inputs, q/k/v, attention scores and probabilities, the
MLP's three intermediate tensors; then the float32 logits, their log-softmax and its
exponent, of every scored position or with streamed logits of one chunk), which XLA may
fuse below.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.mesh import (AXES, PARAM_RULES, ROWS, axis_size,
                                     cache_layer_spec, rule_specs)
from specroll_jax.model.transformer import Transformer
from specroll_jax.model.vocab_chunks import rows_per_chunk
from specroll_jax.rl import grpo, lora
from specroll_jax.rl.adaptation import ProposerMemory
from specroll_jax.rl.run_config import RunConfig

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Workload:
  rollout_rows: int       # the largest rollout batch bucket (rollout.driver.max_batch)
  cache_length: int       # KV slots per row: prompt width + max new tokens
  micro_batch_rows: int   # grpo.micro_batch_size
  learner_width: int      # tokens per learner row
  lora_rank: int = 0
  lora_targets: str = lora.DEFAULT_TARGETS
  proposer: ProposerMemory | None = None  # the learned proposer's part
  stream_logits: bool = False  # grpo.stream_logits
  scored_width: int = 0        # positions per row the loss projects (grpo.score_span; 0 = all)

  @classmethod
  def from_config(cls, config: RunConfig, width: int,
                  proposer: ProposerMemory | None) -> 'Workload':
    """The workload of a run at learner width `width`."""
    g = config.grpo
    return cls(rollout_rows=config.rollout.driver.max_batch, cache_length=width,
               micro_batch_rows=g.micro_batch_size, learner_width=width,
               lora_rank=g.lora_rank, lora_targets=g.lora_targets, proposer=proposer,
               stream_logits=g.stream_logits, scored_width=g.score_span)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  mesh: dict                 # axis -> size
  parts: tuple               # ((name, bytes per device), ...)

  @property
  def total(self) -> int:
    return sum(b for _, b in self.parts)

  def table(self) -> str:
    shape = ' x '.join(f'{a}={self.mesh[a]}' for a in AXES)
    lines = [f'memory per device on mesh {shape}:']
    lines += [f'  {name:<34} {b / GIB:9.3f} GiB' for name, b in self.parts]
    lines.append(f'  {"total":<34} {self.total / GIB:9.3f} GiB')
    return '\n'.join(lines)


def _piece_bytes(sizes, leaf, spec: P, dtype=None) -> int:
  """Bytes of one device's piece of `leaf` (a ShapeDtypeStruct) split by `spec`."""
  split = [1 if axis is None else axis_size(sizes, axis) for axis in spec]
  split += [1] * (len(leaf.shape) - len(split))
  return int(np.prod([d // s for d, s in zip(leaf.shape, split)])) * np.dtype(
      dtype or leaf.dtype).itemsize


def _shard_bytes(sizes, shapes, rules, dtype=None) -> int:
  """Bytes of one device's piece of every leaf of `shapes` (ShapeDtypeStructs)."""
  specs = traverse_util.flatten_dict(rule_specs(sizes, shapes, rules), sep='/')
  return sum(_piece_bytes(sizes, leaf, specs[path], dtype)
             for path, leaf in traverse_util.flatten_dict(shapes, sep='/').items())


def _optimizer_bytes(sizes, trained) -> int:
  """One device's piece of the learner's AdamW state: moments split like the parameters
  they mirror, the step count replicated (mesh.optimizer_sharding)."""
  optimizer = grpo.make_optimizer(grpo.GRPOConfig())
  state = jax.eval_shape(optimizer.init, trained)
  pieces = optax.tree_map_params(
      optimizer, lambda leaf, spec: _piece_bytes(sizes, leaf, spec), state,
      rule_specs(sizes, trained, PARAM_RULES),
      transform_non_params=lambda leaf: _piece_bytes(sizes, leaf, P()),
      is_leaf=lambda x: isinstance(x, P))
  return sum(jax.tree.leaves(pieces))


def param_shapes(config: ModelConfig):
  """The policy's parameter shapes and dtypes, without allocating them."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  # Through the projection too: an untied lm_head is created only where it is used.
  forward = lambda model: model.project(model(tokens, tokens, jnp.ones((1, 1, 1), bool))[0])
  return jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0),
                                                         method=forward)['params'])


def report(config: ModelConfig, workload: Workload, mesh: dict) -> MemoryReport:
  """Bytes per device of `workload` on a mesh of shape `mesh` ({'data': .., 'fsdp': ..,
  'tensor': ..})."""
  params = param_shapes(config)
  parts = [('parameters', _shard_bytes(mesh, params, PARAM_RULES))]
  trained = params
  if workload.lora_rank:
    adapters = jax.eval_shape(lambda p: lora.init_adapters(p, workload.lora_rank,
                                                           workload.lora_targets, 0), params)
    targeted = lora.targeted_kernels(params, workload.lora_targets)
    parts.append(('merged weights (rollouts)',
                  _shard_bytes(mesh, traverse_util.unflatten_dict(targeted, sep='/'),
                               PARAM_RULES)))
    parts.append(('LoRA adapters', _shard_bytes(mesh, adapters, PARAM_RULES)))
    trained = adapters
  parts.append(('gradients (float32 accumulator)',
                _shard_bytes(mesh, trained, PARAM_RULES, np.float32)))
  parts.append(('optimizer (AdamW moments)', _optimizer_bytes(mesh, trained)))
  if workload.proposer is not None:
    p = workload.proposer
    # The slow path's AdamW moments exist while it consolidates.
    parts.append((p.label, p.copies * _shard_bytes(mesh, p.shapes, p.rules)))
  layer = jax.ShapeDtypeStruct((workload.rollout_rows, config.num_kv_heads,
                                 workload.cache_length, config.head_dim), config.cache_dtype)
  cache = 2 * config.num_layers * _piece_bytes(mesh, layer, cache_layer_spec(mesh, layer.shape))
  parts.append((f'KV cache ({workload.rollout_rows} rows x {workload.cache_length} slots)', cache))
  parts.append(('learner activations (estimate)',
                _activation_bytes(config, workload, axis_size(mesh, ROWS), mesh['tensor'])))
  return MemoryReport(mesh=dict(mesh), parts=tuple(parts))


def _activation_bytes(config: ModelConfig, workload: Workload, rows: int, tensor: int) -> int:
  c, width = config, workload.learner_width
  act = np.dtype(c.activation_dtype).itemsize
  split = lambda n: n // tensor if n % tensor == 0 else n
  per_token_layer = act * (4 * c.hidden_size + 3 * split(c.num_heads * c.head_dim)
                           + 4 * split(c.num_kv_heads * c.head_dim)
                           + 3 * split(c.intermediate_size))
  scores = 2 * 4 * split(c.num_heads) * width  # float32 scores and probabilities per query
  micro_rows = max(1, workload.micro_batch_rows // rows)
  positions = micro_rows * width
  layers = positions * c.num_layers * (per_token_layer + scores)
  scored = micro_rows * min(width, workload.scored_width or width)
  logit_positions = (rows_per_chunk(c.vocab_size, scored) if workload.stream_logits
                     else scored)
  return layers + logit_positions * 3 * 4 * split(c.vocab_size)
