"""Horizon heads: H residual blocks on the policy's last hidden state.

Head k (1..H) maps h_t to z_{t,k} = h_t + W2_k silu(W1_k norm_k(h_t)) and predicts token
x_{t+k+1} through the policy's own vocabulary projection W: q_{t,k} = S(W z_{t,k}). There is
no second backbone and no second KV cache; head parameters are their own pytree. W2 starts
at zero, so a fresh head proposes the policy's own next-token distribution.

Heads may be restricted to a draft vocabulary (speculative/draft_vocabulary.py): W's rows
for those tokens only, in proposals and in training. On SmolLM2 that makes each (position,
head) projection 6x cheaper, which is what lets a warm start train on ~10^5 positions in
minutes on a CPU. The vocabulary is fixed at the warm start (the slow path keeps it), so it
is part of the static config; the file stores it as a tensor beside the weights.
"""
import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from safetensors import SafetensorError
from safetensors.flax import load_file

from specroll_jax.model.checkpoint import (save_record_and_tensors, unflatten_tensors,
                                           unreadable)
from specroll_jax.model.config import ModelConfig
from specroll_jax.speculative.draft_vocabulary import VOCAB_TENSOR, check_vocabulary

HEADS_FILE = 'heads.safetensors'
HEADS_CONFIG_FILE = 'heads_config.json'


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  num_heads: int = 4
  hidden_multiplier: float = 1.0  # inner width of each residual block, in units of D
  # Ascending token ids the heads may draft; empty: the policy's whole vocabulary.
  draft_vocab: tuple = ()

  def __post_init__(self):
    object.__setattr__(self, 'draft_vocab', tuple(int(i) for i in self.draft_vocab))

  def __repr__(self):
    # 8,192 ids would bury every message that prints a config.
    return (f'HeadsConfig(num_heads={self.num_heads}, hidden_multiplier='
            f'{self.hidden_multiplier}, draft_vocab=<{len(self.draft_vocab)} ids>)')

  def vocab_ids(self):
    """int32 [V_d] the draft vocabulary, or None for the whole vocabulary."""
    return jnp.asarray(self.draft_vocab, jnp.int32) if self.draft_vocab else None

  def inner_size(self, model_config: ModelConfig) -> int:
    return max(1, int(round(self.hidden_multiplier * model_config.hidden_size)))


class HorizonHeads(nn.Module):
  """h [..., D] -> z [..., H, D], the per-head hidden states fed to the shared projection."""
  config: HeadsConfig
  model_config: ModelConfig

  @nn.compact
  def __call__(self, hidden):
    c, m = self.config, self.model_config
    dim, inner = m.hidden_size, c.inner_size(m)
    norm = self.param('norm', nn.initializers.ones, (c.num_heads, dim), jnp.float32)
    w1 = self.param('w1', nn.initializers.variance_scaling(1.0, 'fan_in', 'normal',
                                                           in_axis=1, out_axis=2),
                    (c.num_heads, dim, inner), jnp.float32)
    w2 = self.param('w2', nn.initializers.zeros, (c.num_heads, inner, dim), jnp.float32)
    h = hidden.astype(jnp.float32)
    normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + m.rms_norm_eps)
    normed = normed[..., None, :] * norm
    update = jnp.einsum('...hf,hfd->...hd', nn.silu(jnp.einsum('...hd,hdf->...hf', normed, w1)), w2)
    return (h[..., None, :] + update).astype(hidden.dtype)


def init_heads(config: HeadsConfig, model_config: ModelConfig, seed: int = 0) -> dict:
  dummy = jnp.zeros((1, model_config.hidden_size), model_config.jnp_dtype)
  return HorizonHeads(config, model_config).init(jax.random.key(seed), dummy)['params']


def apply_heads(config: HeadsConfig, model_config: ModelConfig, params, hidden):
  return HorizonHeads(config, model_config).apply({'params': params}, hidden)


@dataclasses.dataclass(frozen=True)
class HeadsMetadata:
  """How a set of heads was warm-started, stored beside them in heads_config.json."""
  source: str             # the policy checkpoint (or default-policy build) they were trained on
  num_sequences: int      # self-generated training sequences
  max_new_tokens: int     # tokens per generated sequence
  temperature: float      # sampling temperature of those generations
  steps: int              # optimizer steps
  final_loss: float
  rank_hit_rate: tuple    # [H][ranks] held-out rate at which head k's rank-r token was realised
  seconds: float | None = None  # generation, targets and training, wall clock (None: not timed)

  def __post_init__(self):
    object.__setattr__(self, 'rank_hit_rate',
                       tuple(tuple(float(x) for x in row) for row in self.rank_hit_rate))


def save_heads(directory, config: HeadsConfig, params,
               metadata: HeadsMetadata | None = None) -> None:
  """Writes heads.safetensors (weights, and the draft vocabulary as tensor 'draft_vocab')
  + heads_config.json (hyperparameters, the vocabulary's size, training metadata)."""
  hyper = {'num_heads': config.num_heads, 'hidden_multiplier': config.hidden_multiplier,
           'draft_vocab_size': len(config.draft_vocab)}
  record = {'heads': hyper,
            'metadata': None if metadata is None else dataclasses.asdict(metadata)}
  tensors = dict(params)
  if config.draft_vocab:
    tensors[VOCAB_TENSOR] = config.vocab_ids()
  save_record_and_tensors(directory, HEADS_CONFIG_FILE, record, HEADS_FILE, tensors)


def heads_metadata(directory) -> HeadsMetadata | None:
  """The training metadata save_heads stored (None for heads saved without any)."""
  path = Path(directory) / HEADS_CONFIG_FILE
  try:
    raw = json.loads(path.read_text())['metadata']
    return None if raw is None else HeadsMetadata(**raw)
  except FileNotFoundError:
    raise FileNotFoundError(
        f'{path}: not found (train heads with experiments.train_heads)') from None
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f'{path}: no valid heads metadata ({e}); heads saved before metadata was '
                     'typed need a new warm start (experiments.train_heads)') from None


def has_heads(directory) -> bool:
  """Whether `directory` holds a complete save_heads."""
  return (Path(directory) / HEADS_FILE).is_file()


def load_heads(directory, model_config: ModelConfig) -> tuple[HeadsConfig, dict]:
  """Reads heads saved by save_heads, checking they fit this policy's hidden size and
  vocabulary. Files written before draft vocabularies existed have no 'draft_vocab_size':
  they are whole-vocabulary heads and load as such."""
  directory = Path(directory)
  config_path, weights_path = directory / HEADS_CONFIG_FILE, directory / HEADS_FILE
  for path in (config_path, weights_path):
    if not path.is_file():
      raise FileNotFoundError(f'{path}: not found (train heads with experiments.train_heads)')
  try:
    hyper = dict(json.loads(config_path.read_text())['heads'])
    vocab_size = int(hyper.pop('draft_vocab_size', 0))
    config = HeadsConfig(**hyper)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f'{config_path}: not a heads config ({e})') from None
  try:
    tensors = load_file(str(weights_path))
  except SafetensorError as e:
    raise unreadable(weights_path, e) from None
  vocab_ids = tensors.pop(VOCAB_TENSOR, None)
  if vocab_size or vocab_ids is not None:
    check_vocabulary(vocab_ids, vocab_size, model_config.vocab_size, weights_path)
    config = dataclasses.replace(config, draft_vocab=tuple(vocab_ids.tolist()))
  expected = jax.eval_shape(lambda: init_heads(config, model_config))
  params = unflatten_tensors(tensors, expected, weights_path, model_config)
  return config, params
