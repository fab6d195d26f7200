"""The speculation gate: each step, a tree only when it is expected to pay for itself.

At a batch bucket a tree step costs `cost` plain (vanilla) steps, as measured on the
engine's own steps by spec/step_cost.py. A tree step emits 1 + accepted tokens per row, and a
plain step emits 1. For each row the gate keeps a running mean of the draft tokens accepted
per tree step. It runs the tree when the running rows' mean says 1 + accepted > cost.

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
  tree_steps: jax.Array  # int32 [B] tree steps this response has taken
  since_tree: jax.Array  # int32 [B] steps since this response's last tree step
  interval: jax.Array    # int32 [B] plain steps before this response's next probe

  @classmethod
  def init(cls, config: GateConfig, batch: int) -> 'GateState':
    zeros = jnp.zeros((batch,), jnp.int32)
    return cls(accepted=jnp.zeros((batch,)), tree_steps=zeros, since_tree=zeros,
               interval=jnp.full((batch,), config.probe_interval, jnp.int32))


def expected_tokens(state: GateState, running) -> jax.Array:
  """Tokens per row that a tree step is expected to emit: 1 + the running rows' mean."""
  live = running.astype(jnp.float32)
  return 1.0 + jnp.sum(live * state.accepted) / jnp.maximum(jnp.sum(live), 1.0)


def tree_pays(config: GateConfig, state: GateState, running, cost: float) -> jax.Array:
  """bool []: run the tree at this step (warming up, probing, or expected to pay)."""
  warming_up = jnp.any(running & (state.tree_steps < config.warmup_tree_steps))
  probing = jnp.any(running & (state.since_tree >= state.interval))
  return warming_up | probing | (expected_tokens(state, running) > cost)


def after_tree(config: GateConfig, state: GateState, accepted, running, cost: float) -> GateState:
  """Folds a tree step's accepted draft tokens per row (int [B]) into the running means,
  and resets (the tree paid) or doubles (it did not) the probe interval."""
  steps = state.tree_steps + running.astype(jnp.int32)
  weight = 1.0 / jnp.minimum(jnp.maximum(steps, 1), config.horizon).astype(jnp.float32)
  mean = state.accepted + weight * (accepted.astype(jnp.float32) - state.accepted)
  updated = GateState(accepted=jnp.where(running, mean, state.accepted), tree_steps=steps,
                      since_tree=jnp.where(running, 0, state.since_tree),
                      interval=state.interval)
  backed_off = jnp.minimum(2 * state.interval, config.max_probe_interval)
  interval = jnp.where(expected_tokens(updated, running) > cost, config.probe_interval,
                       backed_off)
  return updated.replace(interval=jnp.where(running, interval, state.interval))


def after_plain(state: GateState, running) -> GateState:
  return state.replace(since_tree=state.since_tree + running.astype(jnp.int32))
