"""A context-attending drafter: one decoder layer over the response so far (EAGLE's shape).

The sequential drafter (drafter.py) sees h_t and one token: an MLP with no view of the
context beyond what h_t carries, and its feature-loss ablation said its inputs, not its
objective, limit it (notes/history.md, issue 46). This drafter is one decoder layer,
attention then a residual MLP, whose keys are its own fused inputs at the response's
earlier positions:

  u_j = F(h_j, e(x_{j+1}))             entry j: the policy's state at j, the token after it
  z_1 = L(u_t ; u_{<t}, u_t)           depth 1 at the last verified position t
  u^d = F(z_{d-1}, e(y_d))             deeper: the chain of its own drafts y_2 .. y_d,
  z_d = L(u^d ; u_{<t}, u_t, u^2 .. u^d)

F fuses the two normalised inputs; L attends from its input to the keys listed after the
semicolon and adds a residual MLP; q_d = S(W_v z_d) over a draft vocabulary, as the
sequential drafter's. Keys carry RoPE at their positions (entry j at j, the chain's depth d
at t + d - 1). The keys and values of u_{<t} are the proposer's per-row cache
(context_drafter_proposer.py): written once per accepted token, from the verifier's own
hidden states, never from a rejected node. Training sees the same keys in one parallel pass
(`teacher_forced_states`): entries strictly before j, then j's own chain, so a drafted path
that the walk accepts got exactly the law training taught (tests/speculative/
test_context_drafter.py checks the two against each other).

h_j is the policy's final hidden state, or, with `feature_layers`, its fusion with those
decoder layers' outputs at j (the sequential drafter's `first_state`: EAGLE-3's low, middle
and high features), for the entries and the root alike; the engine captures the layers in
every forward for such a proposer.
"""
import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.transformer import apply_rope, rope_tables
from specroll_jax.speculative.drafter import DrafterConfig, rms, without_fusion
from specroll_jax.speculative.pairs import shifted

CONTEXT_DRAFTER_FILE = 'context_drafter.safetensors'
CONTEXT_DRAFTER_CONFIG_FILE = 'context_drafter_config.json'


@dataclasses.dataclass(frozen=True)
class ContextDrafterConfig(DrafterConfig):
  """The sequential drafter's fields, plus the layer's attention heads (of the policy's head
  size, so the policy's RoPE tables apply)."""
  num_heads: int = 4
  weights_file: ClassVar[str] = CONTEXT_DRAFTER_FILE
  config_file: ClassVar[str] = CONTEXT_DRAFTER_CONFIG_FILE

  def __post_init__(self):
    super().__post_init__()
    if self.num_heads < 1:
      raise ValueError(f'ContextDrafterConfig: num_heads >= 1 required, got {self}')

  @classmethod
  def from_block(cls, block: DrafterConfig, num_heads: int) -> 'ContextDrafterConfig':
    """The sequential drafter's shape `block` with an attention layer of `num_heads` heads."""
    return cls(**dataclasses.asdict(block), num_heads=num_heads)

  def init_weights(self, model_config: ModelConfig, seed: int) -> dict:
    dim = model_config.hidden_size
    z = jnp.zeros((1, 1, dim), jnp.float32)
    positions = jnp.zeros((1, 1), jnp.int32)
    return self.with_fusion(model_config, ContextDrafterLayer(self, model_config).init(
        jax.random.key(seed), z, z, positions, method=ContextDrafterLayer.initialize)['params'],
        seed)

  def teacher_forced_states(self, model_config: ModelConfig, weights, hidden, embedded,
                            valid) -> list:
    """Each depth's state [depth] of [B, T, D] along the realised tokens, with the keys the
    proposer's cache and chain give it when the walk accepts that path: the valid entries
    before t, then t's own chain. `embedded` [B, T, D] holds e(x_t) at t."""
    layer = Layer(self, model_config, weights)
    batch, width = valid.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    entries = layer.entry(self.first_state(model_config, weights, hidden), shifted(embedded, 1))
    keys, values = layer.keys_values(entries, positions)
    earlier = (jnp.arange(width)[None, :] < jnp.arange(width)[:, None])[None] & valid[:, None, :]
    chain_keys, chain_values = keys[:, :, None], values[:, :, None]
    z = layer.attend(entries, positions, keys, values, earlier, chain_keys, chain_values)
    states = [z]
    for d in range(2, self.depth + 1):
      inputs = layer.entry(z, shifted(embedded, d))
      k, v = layer.keys_values(inputs, positions + d - 1)
      chain_keys = jnp.concatenate([chain_keys, k[:, :, None]], axis=2)
      chain_values = jnp.concatenate([chain_values, v[:, :, None]], axis=2)
      z = layer.attend(inputs, positions + d - 1, keys, values, earlier, chain_keys,
                       chain_values)
      states.append(z)
    return states


class ContextDrafterLayer(nn.Module):
  """F (`entry`), the keys and values of an input (`keys_values`) and L (`__call__`)."""
  config: ContextDrafterConfig
  model_config: ModelConfig

  def setup(self):
    c, m = self.config, self.model_config
    dim, width = m.hidden_size, c.num_heads * m.head_dim
    ones = nn.initializers.ones
    self.z_norm = self.param('z_norm', ones, (dim,), jnp.float32)
    self.token_norm = self.param('token_norm', ones, (dim,), jnp.float32)
    self.attention_norm = self.param('attention_norm', ones, (dim,), jnp.float32)
    self.block_norm = self.param('block_norm', ones, (dim,), jnp.float32)
    self.fuse = nn.Dense(dim, use_bias=False)
    self.query = nn.Dense(width, use_bias=False)
    self.key = nn.Dense(width, use_bias=False)
    self.value = nn.Dense(width, use_bias=False)
    # Zero-initialised outputs: a fresh layer is F alone, as a fresh sequential block is.
    self.out = nn.Dense(dim, use_bias=False, kernel_init=nn.initializers.zeros)
    self.up = nn.Dense(max(1, int(round(c.hidden_multiplier * dim))), use_bias=False)
    self.down = nn.Dense(dim, use_bias=False, kernel_init=nn.initializers.zeros)

  def _norm(self, x, scale):
    return rms(x, self.model_config.rms_norm_eps) * scale

  def _heads(self, x, dense, positions, rotate: bool):
    """[B, Q, D] -> [B, Q, H, Dh], rotated at `positions` [B, Q] where `rotate`."""
    out = dense(self._norm(x, self.attention_norm))
    out = out.reshape(x.shape[:-1] + (self.config.num_heads, self.model_config.head_dim))
    return apply_rope(out, *rope_tables(positions, self.model_config)) if rotate else out

  def entry(self, z, embedded):
    """F: [B, Q, D] x [B, Q, D] -> u [B, Q, D]."""
    return self.fuse(jnp.concatenate(
        [self._norm(z.astype(jnp.float32), self.z_norm),
         self._norm(embedded.astype(jnp.float32), self.token_norm)], axis=-1))

  def keys_values(self, u, positions):
    """The keys (rotated) and values [B, Q, H, Dh] of inputs u [B, Q, D] at `positions`."""
    return (self._heads(u, self.key, positions, rotate=True),
            self._heads(u, self.value, positions, rotate=False))

  def __call__(self, u, positions, keys, values, visible, chain_keys, chain_values):
    """L: inputs u [B, Q, D] at `positions` [B, Q] attend to shared keys/values
    [B, S, H, Dh] where `visible` [B, Q or 1, S], and to each query's own chain
    [B, Q, C, H, Dh] (C >= 1: the chain ends with the query's own key)."""
    q = self._heads(u, self.query, positions, rotate=True) / math.sqrt(self.model_config.head_dim)
    shared = jnp.einsum('bqhd,bshd->bqhs', q, keys)
    shared = jnp.where(visible[:, :, None, :], shared, -jnp.inf)
    chain = jnp.einsum('bqhd,bqchd->bqhc', q, chain_keys)
    weights = jax.nn.softmax(jnp.concatenate([shared, chain], axis=-1), axis=-1)
    split = keys.shape[1]
    mixed = (jnp.einsum('bqhs,bshd->bqhd', weights[..., :split], values)
             + jnp.einsum('bqhc,bqchd->bqhd', weights[..., split:], chain_values))
    y = u + self.out(mixed.reshape(mixed.shape[:2] + (-1,)))
    return y + self.down(nn.silu(self.up(self._norm(y, self.block_norm))))

  def initialize(self, z, embedded, positions):
    """Touches every parameter once (init's entry point)."""
    u = self.entry(z, embedded)
    k, v = self.keys_values(u, positions)
    visible = jnp.ones(k.shape[:2] + (k.shape[1],), bool)
    return self(u, positions, k, v, visible, k[:, :, None], v[:, :, None])


@dataclasses.dataclass(frozen=True)
class Layer:
  """ContextDrafterLayer's methods bound to its weights (what the proposer and training call)."""
  config: ContextDrafterConfig
  model_config: ModelConfig
  weights: dict

  def _apply(self, method, *args):
    return ContextDrafterLayer(self.config, self.model_config).apply(
        {'params': without_fusion(self.weights)}, *args, method=method)

  def entry(self, z, embedded):
    return self._apply(ContextDrafterLayer.entry, z, embedded)

  def keys_values(self, u, positions):
    return self._apply(ContextDrafterLayer.keys_values, u, positions)

  def attend(self, u, positions, keys, values, visible, chain_keys, chain_values):
    return self._apply(ContextDrafterLayer.__call__, u, positions, keys, values, visible,
                       chain_keys, chain_values)
