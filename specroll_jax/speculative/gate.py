"""The speculation gate: each step, a tree only when it is expected to pay for itself.

At a batch bucket a tree step costs `cost` plain (vanilla) steps, as measured on the
engine's own steps by speculative/step_cost.py. A tree step emits 1 + accepted tokens per row, and a
plain step emits 1. It runs the tree when the running rows' expected 1 + accepted > cost.

What a row accepts is bounded by the levels its tree reaches, `min(depth, width - 1)`, and
the driver's compaction widens the trees (W4, SmolLM2 at 32 -> 16 rows: 2 nodes, 1 level ->
4 nodes, 3 levels). A mean of accepted tokens learned on 1-level trees caps the expectation
at 2 tokens, below a 3-level tree's price of 2.60 plain steps, and the gate ran plain steps
where the oracle's trees emitted 3.99 tokens. So each row keeps the acceptance rate per level:
each level the walk reached is a trial, accepted if its token matched (a row that accepts
a < L of L levels made a + 1 trials, one that accepts all L made L). A row of rate r expects
r + r^2 + ... + r^L tokens from L levels: exact for a chain whose levels accept
independently at r; wider trees accept more per level, so after compaction it errs low.

Rows learn nothing during plain steps, so the gate probes with one tree step after
`probe_interval` plain steps, and the first `warmup_tree_steps` steps of a response are
always trees. A probe that does not pay doubles the row's interval (up to
`max_probe_interval`), and a tree that pays resets it. Both kinds of step emit exactly the
vanilla tokens, so the gate changes only the speed.

When trees do not pay, each probe and each warm-up step wastes (cost - 1 - accepted) plain
steps. A response of S steps takes about log2(S / probe_interval) + 1 probes. On
stories260K at 16 rows (cost 3.3 with random heads, S = 256), two warm-up trees and probes at
a fixed interval of 64 cost 5.8% of a plain loop. On W1 (S ~ 40 steps, cost 2.1-2.3) two
warm-up trees alone cost ~6%, hence one.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class GateConfig:
  warmup_tree_steps: int = 1  # trees every response starts with, before the mean is trusted
  probe_interval: int = 32    # plain steps before the first probing tree step
  max_probe_interval: int = 512  # the longest run of plain steps, after probes that failed
  horizon: int = 16           # the mean covers the first `horizon` trees, then decays at 1/horizon

  def __post_init__(self):
    if self.warmup_tree_steps < 1 or self.probe_interval < 1 or self.horizon < 1:
      raise ValueError('GateConfig: warmup_tree_steps, probe_interval and horizon must be '
                       f'>= 1, got {self}')
    if self.max_probe_interval < self.probe_interval:
      raise ValueError(f'GateConfig: max_probe_interval {self.max_probe_interval} < '
                       f'probe_interval {self.probe_interval}')


@struct.dataclass
class GateState:
  """Per-row state, so it survives the driver's compaction like every other row."""
  accepted: jax.Array    # float32 [B] mean draft tokens accepted per tree step
  attempted: jax.Array   # float32 [B] mean levels tried per tree step (accepted + a miss)
  tree_steps: jax.Array  # int32 [B] tree steps this response has taken
  since_tree: jax.Array  # int32 [B] steps since this response's last tree step
  interval: jax.Array    # int32 [B] plain steps before this response's next probe

  @classmethod
  def init(cls, config: GateConfig, batch: int) -> 'GateState':
    zeros = jnp.zeros((batch,), jnp.int32)
    return cls(accepted=jnp.zeros((batch,)), attempted=jnp.zeros((batch,)), tree_steps=zeros,
               since_tree=zeros, interval=jnp.full((batch,), config.probe_interval, jnp.int32))

  @property
  def level_rate(self) -> jax.Array:
    """float32 [B]: the fraction of tried levels accepted (0 before a row's first tree)."""
    return jnp.where(self.attempted > 0, self.accepted / jnp.maximum(self.attempted, 1e-9), 0.0)


def expected_tokens(state: GateState, running, levels: int) -> jax.Array:
  """Tokens per row that a tree of `levels` levels is expected to emit: 1 + the running
  rows' mean of r + ... + r^levels."""
  live = running.astype(jnp.float32)
  powers = state.level_rate[:, None] ** jnp.arange(1, levels + 1, dtype=jnp.float32)
  return 1.0 + jnp.sum(live * jnp.sum(powers, axis=1)) / jnp.maximum(jnp.sum(live), 1.0)


def tree_pays(config: GateConfig, state: GateState, running, cost: float,
              levels: int) -> jax.Array:
  """bool []: run the tree of `levels` levels at this step (warming up, probing, or
  expected to pay)."""
  warming_up = jnp.any(running & (state.tree_steps < config.warmup_tree_steps))
  probing = jnp.any(running & (state.since_tree >= state.interval))
  return warming_up | probing | (expected_tokens(state, running, levels) > cost)


def after_tree(config: GateConfig, state: GateState, accepted, running, cost: float,
               levels: int) -> GateState:
  """Folds a tree step's accepted draft tokens per row (int [B]) out of `levels` into the
  running means, and resets (the tree paid) or doubles (it did not) the probe interval."""
  steps = state.tree_steps + running.astype(jnp.int32)
  weight = 1.0 / jnp.minimum(jnp.maximum(steps, 1), config.horizon).astype(jnp.float32)
  accepted = accepted.astype(jnp.float32)
  attempted = jnp.minimum(accepted + 1.0, float(levels))
  fold = lambda mean, sample: jnp.where(running, mean + weight * (sample - mean), mean)
  updated = GateState(accepted=fold(state.accepted, accepted),
                      attempted=fold(state.attempted, attempted), tree_steps=steps,
                      since_tree=jnp.where(running, 0, state.since_tree),
                      interval=state.interval)
  backed_off = jnp.minimum(2 * state.interval, config.max_probe_interval)
  interval = jnp.where(expected_tokens(updated, running, levels) > cost, config.probe_interval,
                       backed_off)
  return updated.replace(interval=jnp.where(running, interval, state.interval))


def after_plain(state: GateState, running) -> GateState:
  return state.replace(since_tree=state.since_tree + running.astype(jnp.int32))
