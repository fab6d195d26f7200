"""A sequential drafter: one small block that drafts the next token from the last one.

Horizon heads (speculative/heads.py) read only h_t, so head 1 guesses x_{t+2} without knowing the
root x_{t+1} the verifier has just drawn; at T = 1 the root is a draw from a broad
distribution and that guess is mostly wrong (W3 heads: held-out top-1 0.21 for head 1).
The drafter conditions every depth on the token drafted before it (EAGLE and Hydra do the
same with larger blocks):

  z_0 = h_t,  z_d = f(z_{d-1}, e(y_d)),  q_d = S(W_v z_d)

(or z_0 a fusion of h_t with earlier decoder layers' outputs, `feature_layers`: EAGLE-3's
low/mid/high features, which the engine captures in its forwards for such a proposer;
experiments.measure.drafter_features)

where y_1 is the root, y_{d+1} the drafter's own best guess at depth d, e the policy's input
embedding and W_v the policy's vocabulary projection restricted to a draft vocabulary: the
`draft_vocab_size` tokens most frequent as next tokens in the drafter's training text (a
frequency-ranked vocabulary, as FR-Spec does). Tokens outside it are never drafted; each
depth's projection then reads V_d rows of W instead of V (8,192 of SmolLM2's 49,152).
f is a fusion of the two normalised inputs followed by one residual MLP block; its
parameters are the only ones trained, the embedding and projection stay the policy's.
"""
import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from safetensors import SafetensorError
from safetensors.flax import load_file

from specroll_jax.model.checkpoint import (save_record_and_tensors, unflatten_tensors,
                                           unreadable)
from specroll_jax.model.config import ModelConfig
from specroll_jax.speculative.draft_vocabulary import VOCAB_TENSOR, check_vocabulary
from specroll_jax.speculative.pairs import shifted

DRAFTER_FILE = 'drafter.safetensors'
DRAFTER_CONFIG_FILE = 'drafter_config.json'
FEATURES = 'features'  # the weights of z_0's feature fusion, when the drafter has one


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  """The sequential drafter's shape. Every drafter kind's config has these fields and
  methods (speculative/context_drafter.py is the other): training, files and the
  rank-path proposer are shared."""
  depth: int = 4                 # deepest level it drafts
  hidden_multiplier: float = 2.0  # inner width of the residual block, in units of D
  draft_vocab_size: int = 8192   # tokens it may draft (0: the whole vocabulary)
  # Decoder layers (0-based) whose outputs z_0 fuses with h_t, as EAGLE-3 fuses low, mid and
  # high features; its pairs' hidden then holds [h_t, those outputs] (padded_sequence_features).
  # (): z_0 = h_t.
  feature_layers: tuple = ()
  weights_file: ClassVar[str] = DRAFTER_FILE
  config_file: ClassVar[str] = DRAFTER_CONFIG_FILE

  def __post_init__(self):
    object.__setattr__(self, 'feature_layers', tuple(int(i) for i in self.feature_layers))
    if (self.depth < 1 or self.hidden_multiplier <= 0 or self.draft_vocab_size < 0
        or min(self.feature_layers, default=0) < 0):
      raise ValueError(f'{type(self).__name__}: depth >= 1, hidden_multiplier > 0, '
                       f'draft_vocab_size >= 0 and feature_layers >= 0 required, got {self}')

  def vocab_size(self, model_config: ModelConfig) -> int:
    if self.draft_vocab_size == 0:
      return model_config.vocab_size
    return min(self.draft_vocab_size, model_config.vocab_size)

  def init_weights(self, model_config: ModelConfig, seed: int) -> dict:
    dummy = jnp.zeros((1, model_config.hidden_size), jnp.float32)
    return self.with_fusion(
        model_config, DrafterBlock(self, model_config).init(jax.random.key(seed), dummy,
                                                            dummy)['params'], seed)

  def with_fusion(self, model_config: ModelConfig, weights: dict, seed: int) -> dict:
    """A kind's fresh `weights` with a fresh feature fusion beside them (FEATURES), where the
    drafter reads layer features; every kind fuses them the same way (`first_state`)."""
    if max(self.feature_layers, default=-1) >= model_config.num_layers:
      raise ValueError(f'{type(self).__name__}: feature_layers={self.feature_layers}, but the '
                       f'policy has {model_config.num_layers} decoder layers (0-based)')
    if not self.feature_layers:
      return weights
    features = jnp.zeros((1, (1 + len(self.feature_layers)) * model_config.hidden_size))
    return {**weights, FEATURES: FeatureFusion(model_config).init(
        jax.random.key(seed), features)['params']}

  def first_state(self, model_config: ModelConfig, weights, hidden):
    """z_0 [..., D] from the pairs' hidden: h_t, or h_t fused with the feature layers'."""
    if not self.feature_layers:
      return hidden.astype(jnp.float32)
    return FeatureFusion(model_config).apply({'params': weights[FEATURES]}, hidden)

  def teacher_forced_states(self, model_config: ModelConfig, weights, hidden, embedded,
                            valid) -> list:
    """Each depth's state [depth] of [B, T, D] along the realised tokens, as the tree
    drafts along an accepted path: z_d at t from h_t and e(x_{t+1}) .. e(x_{t+d}).
    `embedded` [B, T, D] holds e(x_t) at t; `valid` [B, T] is unused (no context)."""
    del valid
    z, states = self.first_state(model_config, weights, hidden), []
    for d in range(1, self.depth + 1):
      z = drafter_step(self, model_config, weights, z, shifted(embedded, d))
      states.append(z)
    return states


@struct.dataclass
class DrafterParams:
  weights: dict           # the block's parameters: the only trained leaves
  vocab_ids: jax.Array    # int32 [V_d] the draft vocabulary's policy token ids


def rms(x, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class FeatureFusion(nn.Module):
  """[h_t, layer outputs...] [..., (1 + L) D] -> z_0 [..., D]: each part RMS-normalised (the
  residual stream's scale grows with depth) and scaled, then one projection, which starts
  as h_t's normalised part alone, so training starts from the drafter that reads h_t."""
  model_config: ModelConfig

  @nn.compact
  def __call__(self, features):
    m = self.model_config
    dim = m.hidden_size
    parts = jnp.split(features.astype(jnp.float32), features.shape[-1] // dim, axis=-1)
    scale = lambda i: self.param(f'norm_{i}', nn.initializers.ones, (dim,), jnp.float32)
    normed = jnp.concatenate([rms(x, m.rms_norm_eps) * scale(i) for i, x in enumerate(parts)],
                             axis=-1)
    first = lambda key, shape, dtype: jnp.eye(shape[0], shape[1], dtype=dtype)
    return nn.Dense(dim, use_bias=False, kernel_init=first, name='project')(normed)


class DrafterBlock(nn.Module):
  """(z [..., D], e [..., D]) -> the next depth's hidden state z' [..., D]."""
  config: DrafterConfig
  model_config: ModelConfig

  @nn.compact
  def __call__(self, z, embedded):
    m = self.model_config
    dim = m.hidden_size
    inner = max(1, int(round(self.config.hidden_multiplier * dim)))
    z, embedded = z.astype(jnp.float32), embedded.astype(jnp.float32)
    scale = lambda name: self.param(name, nn.initializers.ones, (dim,), jnp.float32)
    inputs = jnp.concatenate([rms(z, m.rms_norm_eps) * scale('z_norm'),
                              rms(embedded, m.rms_norm_eps) * scale('token_norm')], axis=-1)
    fused = nn.Dense(dim, use_bias=False, name='fuse')(inputs)
    update = nn.Dense(dim, use_bias=False, kernel_init=nn.initializers.zeros, name='down')(
        nn.silu(nn.Dense(inner, use_bias=False, name='up')(
            rms(fused, m.rms_norm_eps) * scale('block_norm'))))
    return fused + update


def init_drafter(config, model_config: ModelConfig, vocab_ids, seed: int = 0) -> DrafterParams:
  """Fresh weights of a drafter of any kind over the draft vocabulary `vocab_ids` (int [V_d])."""
  return DrafterParams(weights=config.init_weights(model_config, seed),
                       vocab_ids=jnp.asarray(vocab_ids, jnp.int32))


def without_fusion(weights: dict) -> dict:
  """A drafter's weights less its feature fusion: what its block or layer applies."""
  return {name: w for name, w in weights.items() if name != FEATURES}


def drafter_step(config: DrafterConfig, model_config: ModelConfig, weights, z, embedded):
  return DrafterBlock(config, model_config).apply({'params': without_fusion(weights)}, z,
                                                  embedded)


@dataclasses.dataclass(frozen=True)
class DrafterMetadata:
  """How a drafter was trained, stored beside it in drafter_config.json."""
  source: str            # the policy checkpoint it was trained on
  num_sequences: int     # training sequences (the policy's own generations)
  positions: int         # training positions
  steps: int             # optimizer steps
  final_loss: float
  seconds: float         # generation, targets and training, wall clock
  top1_by_depth: tuple   # [depth] held-out agreement of the top-1 draft with the drawn token
  mass_by_depth: tuple   # [depth] held-out policy mass on the top-1 draft (teacher-forced)
  vocab_coverage: float  # held-out drawn tokens inside the draft vocabulary

  def __post_init__(self):
    for name in ('top1_by_depth', 'mass_by_depth'):
      object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))


def save_drafter(directory, config, params: DrafterParams,
                 metadata: DrafterMetadata | None = None) -> None:
  """Writes the kind's weights file (weights and draft vocabulary) and its config record
  (drafter.safetensors + drafter_config.json for the sequential drafter)."""
  record = {'drafter': dataclasses.asdict(config),
            'metadata': None if metadata is None else dataclasses.asdict(metadata)}
  save_record_and_tensors(directory, config.config_file, record, config.weights_file,
                          {**params.weights, VOCAB_TENSOR: params.vocab_ids})


def has_drafter(directory, kind: type = DrafterConfig) -> bool:
  """Whether `directory` holds a drafter of the kind whose config class is `kind`."""
  return (Path(directory) / kind.weights_file).is_file()


def drafter_metadata(directory, kind: type = DrafterConfig) -> DrafterMetadata | None:
  path = Path(directory) / kind.config_file
  raw = _read_record(path)['metadata']
  try:
    return None if raw is None else DrafterMetadata(**raw)
  except TypeError as e:
    raise ValueError(f'{path}: metadata is not a drafter record ({e})') from None


def _read_record(path: Path) -> dict:
  if not path.is_file():
    raise FileNotFoundError(f'{path}: not found (train one with experiments.train_heads '
                            '--proposer=drafter or context_drafter)')
  try:
    record = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not a drafter config ({e})') from None
  if not isinstance(record, dict) or not {'drafter', 'metadata'} <= set(record):
    raise ValueError(f'{path}: not a drafter config (needs "drafter" and "metadata")')
  return record


def load_drafter(directory, model_config: ModelConfig,
                 kind: type = DrafterConfig) -> tuple:
  """Reads a drafter of the kind whose config class is `kind`, saved by save_drafter,
  checking every tensor against this policy: (config, DrafterParams)."""
  directory = Path(directory)
  config_path, weights_path = directory / kind.config_file, directory / kind.weights_file
  try:
    config = kind(**_read_record(config_path)['drafter'])
  except TypeError as e:
    raise ValueError(f'{config_path}: not a drafter config ({e})') from None
  if not weights_path.is_file():
    raise FileNotFoundError(f'{weights_path}: not found (train one with experiments.'
                            'train_heads --proposer=drafter or context_drafter)')
  try:
    tensors = load_file(str(weights_path))
  except SafetensorError as e:
    raise unreadable(weights_path, e) from None
  vocab_ids = tensors.pop(VOCAB_TENSOR, None)
  check_vocabulary(vocab_ids, config.vocab_size(model_config), model_config.vocab_size,
                   weights_path)
  expected = jax.eval_shape(lambda: init_drafter(config, model_config, vocab_ids).weights)
  weights = unflatten_tensors(tensors, expected, weights_path, model_config)
  return config, DrafterParams(weights=weights, vocab_ids=jnp.asarray(vocab_ids, jnp.int32))
