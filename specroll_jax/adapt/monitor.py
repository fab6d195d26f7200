"""Slow path: persistent consolidation of the heads when degradation lasts (METHOD.md 5).

A window is one rollout batch. Per head the monitor reads three numbers from the engine's
own verifier feedback: acceptance (how often the verifier's draw at that depth was one of
the head's candidates, whatever the tree's budget), accepted depth (tokens accepted per
step), and candidate regret (policy mass outside the head's candidates). After every update
(and at the start) a baseline is calibrated over a few windows. A head triggers only when
its acceptance sits >= `drop` below its baseline *and* its regret's robust z-score against
the calibrated history exceeds `regret_z` for `patience` consecutive windows, and not while
cooling down after an update: transient dips are Reflex's job.

An update trains only the triggered heads (Optax over the head pytree, the other heads'
gradients masked out) on pairs the GRPO step's own forward produced (grpo.py,
`harvest_top_k`): KL(p || q_k) + lambda_tok CE + lambda_prox ||phi - phi_anchor||^2. It is
kept per head only if the held-out KL improves; otherwise that head rolls back to the anchor.
The monitor state is a pytree of arrays and rides in the trainer's Orbax checkpoint.
"""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specroll_jax.adapt import distill
from specroll_jax.adapt.distill import DistillBatch, DistillConfig
from specroll_jax.spec.heads import HeadsConfig


@dataclasses.dataclass(frozen=True)
class SlowPathConfig:
  drop: float = 0.05              # acceptance below baseline that counts as degraded
  regret_z: float = 2.5           # robust z-score of regret that counts as degraded
  patience: int = 2               # consecutive degraded windows before a trigger
  cooldown: int = 3               # windows after an update during which a head cannot trigger
  calibration_windows: int = 2    # windows averaged into a fresh baseline
  history: int = 8                # regret windows kept for the robust z-score
  min_regret_scale: float = 0.01  # floor of the robust scale (a quiet history is not 0 noise)
  steps: int = 40                 # Optax steps per update
  batch_size: int = 32
  learning_rate: float = 1e-3
  ce_weight: float = 1.0          # lambda_tok
  prox_weight: float = 1e-2       # lambda_prox, per parameter (mean squared distance)
  held_out_fraction: float = 0.25

  def __post_init__(self):
    if self.patience < 1 or self.calibration_windows < 1 or self.history < 2:
      raise ValueError('patience, calibration_windows must be >= 1 and history >= 2')
    if not 0.0 < self.held_out_fraction < 1.0:
      raise ValueError(f'held_out_fraction must be in (0, 1), got {self.held_out_fraction}')


@struct.dataclass
class WindowStats:
  """One rollout batch's per-head feedback (numpy arrays [H])."""
  acceptance: np.ndarray
  accepted_depth: np.ndarray
  regret: np.ndarray
  proposed: np.ndarray  # bool: the head proposed at a depth the verifier drew this window


def window_stats(responses, branching) -> WindowStats:
  """Per head over a batch of speculative Responses (their engine stats)."""
  stats = [r.stats for r in responses]
  reached = np.sum([s['reached_by_depth'] for s in stats], axis=0)
  hits = np.sum([s['hits_by_rank'] for s in stats], axis=0)
  candidates = np.arange(hits.shape[1])[None, :] < np.asarray(branching)[:, None]
  steps = max(sum(r.steps for r in responses), 1)
  denominator = np.maximum(reached, 1)
  return WindowStats(
      acceptance=np.sum(hits * candidates, axis=1) / denominator,
      accepted_depth=np.sum([s['accepted_by_depth'] for s in stats], axis=0) / steps,
      regret=1.0 - np.sum([s['candidate_mass'] for s in stats], axis=0) / denominator,
      proposed=reached > 0)


@struct.dataclass
class MonitorState:
  baseline: jax.Array          # float32 [H] calibrated acceptance
  calibrating: jax.Array       # int32 [H] windows still to average into the baseline
  regret_history: jax.Array    # float32 [H, history] calibrated regrets, NaN = empty
  consecutive: jax.Array       # int32 [H] consecutive degraded windows
  cooldown: jax.Array          # int32 [H] windows left before the head may trigger again
  updates: jax.Array           # int32 [H] updates kept
  rollbacks: jax.Array         # int32 [H] updates rolled back

  @classmethod
  def init(cls, config: SlowPathConfig, heads: int) -> 'MonitorState':
    return cls(baseline=np.zeros(heads, np.float32),
               calibrating=np.full(heads, config.calibration_windows, np.int32),
               regret_history=np.full((heads, config.history), np.nan, np.float32),
               consecutive=np.zeros(heads, np.int32), cooldown=np.zeros(heads, np.int32),
               updates=np.zeros(heads, np.int32), rollbacks=np.zeros(heads, np.int32))


def regret_z(history: np.ndarray, regret: np.ndarray, min_scale: float) -> np.ndarray:
  """Robust z-score (median / 1.4826 MAD) of this window's regret per head."""
  z = np.zeros(regret.shape, np.float32)
  for h in range(len(regret)):
    seen = history[h][~np.isnan(history[h])]
    if len(seen):
      median = np.median(seen)
      scale = max(1.4826 * np.median(np.abs(seen - median)), min_scale)
      z[h] = (regret[h] - median) / scale
  return z


def observe(config: SlowPathConfig, state: MonitorState, window: WindowStats):
  """Feeds one window; returns (state, triggered bool [H]). Heads that did not propose in
  the window (the batch was too crowded for their depth) are neither judged nor calibrated."""
  state = jax.tree.map(np.array, state)
  active = np.asarray(window.proposed, bool)
  calibrating = active & (state.calibrating > 0)
  left = np.maximum(state.calibrating, 1)
  # Running mean over the calibration windows.
  baseline = np.where(calibrating, state.baseline + (window.acceptance - state.baseline) / (
      config.calibration_windows - left + 1), state.baseline)
  z = regret_z(state.regret_history, window.regret, config.min_regret_scale)
  judged = active & ~calibrating
  degraded = judged & (window.acceptance <= baseline - config.drop) & (z > config.regret_z)
  consecutive = np.where(degraded, state.consecutive + 1, np.where(judged, 0, state.consecutive))
  cooling = state.cooldown > 0
  triggered = degraded & (consecutive >= config.patience) & ~cooling
  history = state.regret_history
  keep = active & ~degraded  # degraded windows do not move the reference
  history = np.where(keep[:, None], np.concatenate([history[:, 1:], window.regret[:, None]], 1),
                     history)
  state = state.replace(
      baseline=baseline.astype(np.float32),
      calibrating=np.where(calibrating, state.calibrating - 1, state.calibrating),
      regret_history=history.astype(np.float32), consecutive=consecutive.astype(np.int32),
      cooldown=np.where(active & cooling, state.cooldown - 1, state.cooldown).astype(np.int32))
  return state, triggered


def after_update(config: SlowPathConfig, state: MonitorState, updated, kept) -> MonitorState:
  """Recalibrates updated heads (their old baseline describes other parameters)."""
  updated, kept = np.asarray(updated, bool), np.asarray(kept, bool)
  return state.replace(
      baseline=np.where(updated, 0.0, state.baseline).astype(np.float32),
      calibrating=np.where(updated, config.calibration_windows, state.calibrating).astype(np.int32),
      regret_history=np.where(updated[:, None], np.nan, state.regret_history).astype(np.float32),
      consecutive=np.where(updated, 0, state.consecutive).astype(np.int32),
      cooldown=np.where(updated, config.cooldown, state.cooldown).astype(np.int32),
      updates=state.updates + (updated & kept), rollbacks=state.rollbacks + (updated & ~kept))


@partial(jax.jit, static_argnums=2)
def response_spans(pairs: DistillBatch, starts, length: int) -> DistillBatch:
  """Rows' positions [start, start + length): with start = the last prompt position this is
  every pair whose horizon lies in the response, at a fraction of a full-width batch's
  cost (prompts are most of a row's width in math tasks)."""
  index = starts[:, None] + jnp.arange(length)[None, :]
  inside = index < pairs.tokens.shape[1]
  index = jnp.minimum(index, pairs.tokens.shape[1] - 1)
  take = lambda x: jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)),
                                       axis=1)
  spans = jax.tree.map(take, pairs)
  return spans.replace(valid=spans.valid & inside)


def _distill_config(config: SlowPathConfig) -> DistillConfig:
  return DistillConfig(ce_weight=config.ce_weight, learning_rate=config.learning_rate,
                       batch_size=config.batch_size, steps=config.steps)


def _per_head(tree, mask):
  """Multiplies every head tensor (head axis first) by a per-head mask."""
  return jax.tree.map(lambda x: x * mask.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype),
                      tree)


def _loss(heads_config, model_config, config: SlowPathConfig, mask, anchor, head_params,
          policy_params, batch):
  kl, ce, count = distill.head_losses(heads_config, model_config, _distill_config(config),
                                      head_params, policy_params, batch)
  per_head = (kl + config.ce_weight * ce) / jnp.maximum(count, 1)
  distance = jax.tree.map(lambda p, a: jnp.mean(jnp.square(p - a).reshape(p.shape[0], -1), 1),
                          head_params, anchor)
  proximal = sum(jax.tree.leaves(distance))
  return jnp.sum(mask * (per_head + config.prox_weight * proximal)) / jnp.maximum(jnp.sum(mask), 1)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _train(heads_config: HeadsConfig, model_config, config: SlowPathConfig, head_params,
           policy_params, batch: DistillBatch, mask, order):
  """`order` [steps, batch_size] row indices; Optax on the head pytree, masked per head."""
  optimizer = distill.make_optimizer(_distill_config(config))
  anchor = head_params

  def step(carry, rows):
    params, opt_state = carry
    minibatch = jax.tree.map(lambda x: x[rows], batch)
    loss, grads = jax.value_and_grad(
        lambda p: _loss(heads_config, model_config, config, mask, anchor, p, policy_params,
                        minibatch))(params)
    updates, opt_state = optimizer.update(_per_head(grads, mask), opt_state, params)
    # Adam's update of a zero gradient is zero; masking again keeps frozen heads bit-exact.
    return (optax.apply_updates(params, _per_head(updates, mask)), opt_state), loss

  (params, _), losses = jax.lax.scan(step, (head_params, optimizer.init(head_params)), order)
  return params, losses[-1]


@partial(jax.jit, static_argnums=(0, 1))
def held_out_kl(heads_config: HeadsConfig, model_config, head_params, policy_params,
                batch: DistillBatch):
  """Mean KL(p || q_k) per head on held-out pairs [H]."""
  kl, _, count = distill.head_losses(heads_config, model_config, DistillConfig(), head_params,
                                     policy_params, batch)
  return kl / jnp.maximum(count, 1)


@dataclasses.dataclass(frozen=True)
class Consolidation:
  params: dict
  kept: np.ndarray        # bool [H] updated heads whose held-out KL improved
  kl_before: np.ndarray   # [H] held-out KL
  kl_after: np.ndarray    # [H] held-out KL of the trained (pre-rollback) heads
  loss: float


def consolidate(heads_config: HeadsConfig, model_config, config: SlowPathConfig, head_params,
                policy_params, pairs: DistillBatch, heads_mask, seed: int,
                rollback: bool = True) -> Consolidation:
  """Trains the heads in `heads_mask` on `pairs`; keeps a head only if held-out KL improves
  (rollback=False keeps every trained head: the always-online baseline)."""
  heads_mask = np.asarray(heads_mask, bool)
  rows = pairs.tokens.shape[0]
  held = max(1, int(round(rows * config.held_out_fraction)))
  if rows - held < 1:
    raise ValueError(f'slow path needs at least 2 harvested rows, got {rows}')
  rng = np.random.default_rng(seed)
  permutation = rng.permutation(rows)
  train_rows, held_rows = np.sort(permutation[held:]), np.sort(permutation[:held])
  take = lambda index: jax.tree.map(lambda x: x[index], pairs)
  train, held_out = take(train_rows), take(held_rows)
  order = np.stack([rng.choice(len(train_rows), min(config.batch_size, len(train_rows)),
                               replace=False) for _ in range(config.steps)])
  mask = jnp.asarray(heads_mask, jnp.float32)
  trained, loss = _train(heads_config, model_config, config, head_params, policy_params, train,
                         mask, jnp.asarray(order))
  before = np.asarray(held_out_kl(heads_config, model_config, head_params, policy_params,
                                  held_out))
  after = np.asarray(held_out_kl(heads_config, model_config, trained, policy_params, held_out))
  kept = heads_mask & ((after < before) | (not rollback))
  keep = jnp.asarray(kept, jnp.float32)
  params = jax.tree.map(lambda new, old: jnp.where(
      keep.reshape((-1,) + (1,) * (new.ndim - 1)) > 0, new, old), trained, head_params)
  return Consolidation(params=params, kept=kept, kl_before=before, kl_after=after,
                       loss=float(loss))
