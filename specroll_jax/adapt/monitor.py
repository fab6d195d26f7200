"""Slow path, first half: the monitor that decides when a head has degraded (METHOD.md 5).

A window is one rollout batch. Per head the monitor reads two numbers from the head
proposer's own verifier feedback: acceptance (how often the verifier's draw at that depth
was one of the head's candidates, whatever the tree's budget) and candidate regret (policy
mass outside the head's candidates). After every update
(and at the start) a baseline is calibrated over a few windows. A head triggers only when
its acceptance sits >= `drop` below its baseline *and* its regret's robust z-score against
the calibrated history exceeds `regret_z` for `patience` consecutive windows, and not while
cooling down after an update: transient dips are Reflex's job.

Gradual drift rarely crosses that level (on W1 a static head's acceptance falls ~0.03 in
60 windows against a window-to-window spread of 0.02-0.05), while retraining on fresh pairs
still pays. So a head is also probed: `probe_interval` windows after its last update it
is consolidated anyway (with the default interval of 4, calibration and cooldown then leave
the level no window to trigger in). A probe that is rolled back (not finite, or with
`ConsolidationConfig.rollback` a held-out KL that did not improve) doubles the head's
interval (up to `max_probe_interval`); one that is kept resets it. What a trigger does is consolidation.py. The monitor state is a pytree of
arrays and rides in the trainer's Orbax checkpoint.
"""
import dataclasses

import jax
import numpy as np
from flax import struct

from specroll_jax.speculative.head_proposer import DepthStats


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
  drop: float = 0.05              # acceptance below baseline that counts as degraded
  regret_z: float = 2.5           # robust z-score of regret that counts as degraded
  patience: int = 2               # consecutive degraded windows before a trigger
  cooldown: int = 3               # windows after an update during which a head cannot trigger
  calibration_windows: int = 2    # windows averaged into a fresh baseline
  history: int = 8                # regret windows kept for the robust z-score
  min_regret_scale: float = 0.01  # floor of the robust scale (a quiet history is not 0 noise)
  probe_interval: int = 4         # windows between probe consolidations of a head; 0 = none
  max_probe_interval: int = 64    # the interval's cap after repeated rollbacks

  def __post_init__(self):
    if self.patience < 1 or self.calibration_windows < 1 or self.history < 2:
      raise ValueError('patience, calibration_windows must be >= 1 and history >= 2')
    if self.probe_interval < 0 or self.max_probe_interval < self.probe_interval:
      raise ValueError(f'probe_interval must be >= 0 and <= max_probe_interval, got '
                       f'{self.probe_interval} and {self.max_probe_interval}')


@struct.dataclass
class WindowStats:
  """One rollout batch's per-head feedback (numpy arrays [H])."""
  acceptance: np.ndarray
  regret: np.ndarray
  proposed: np.ndarray  # bool: the head proposed at a depth the verifier drew this window


def window_stats(heads: list[DepthStats], branching) -> WindowStats:
  """Per head over a batch of speculative responses' head statistics (numpy leaves)."""
  reached = np.sum([s.reached for s in heads], axis=0)
  hits = np.sum([s.hits for s in heads], axis=0)
  candidates = np.arange(hits.shape[1])[None, :] < np.asarray(branching)[:, None]
  denominator = np.maximum(reached, 1)
  return WindowStats(
      acceptance=np.sum(hits * candidates, axis=1) / denominator,
      regret=1.0 - np.sum([s.candidate_mass for s in heads], axis=0) / denominator,
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
  since_update: jax.Array      # int32 [H] windows the head proposed in since its last update
  probe_interval: jax.Array    # int32 [H] windows from an update to the next probe

  @classmethod
  def init(cls, config: MonitorConfig, heads: int) -> 'MonitorState':
    return cls(since_update=np.zeros(heads, np.int32),
               probe_interval=np.full(heads, config.probe_interval, np.int32),
               baseline=np.zeros(heads, np.float32),
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


def observe(config: MonitorConfig, state: MonitorState, window: WindowStats):
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
  since_update = state.since_update + active
  probed = active & (state.probe_interval > 0) & (since_update >= state.probe_interval)
  triggered = (degraded & (consecutive >= config.patience) & ~cooling) | probed
  history = state.regret_history
  keep = active & ~degraded  # degraded windows do not move the reference
  history = np.where(keep[:, None], np.concatenate([history[:, 1:], window.regret[:, None]], 1),
                     history)
  state = state.replace(
      baseline=baseline.astype(np.float32),
      calibrating=np.where(calibrating, state.calibrating - 1, state.calibrating),
      regret_history=history.astype(np.float32), consecutive=consecutive.astype(np.int32),
      since_update=since_update.astype(np.int32),
      cooldown=np.where(active & cooling, state.cooldown - 1, state.cooldown).astype(np.int32))
  return state, triggered


def after_update(config: MonitorConfig, state: MonitorState, updated, kept) -> MonitorState:
  """Recalibrates updated heads (their old baseline describes other parameters) and sets
  their next probe: the base interval after a kept update, twice the last after a rollback."""
  updated, kept = np.asarray(updated, bool), np.asarray(kept, bool)
  interval = np.where(kept, config.probe_interval,
                      np.minimum(2 * state.probe_interval, config.max_probe_interval))
  return state.replace(
      since_update=np.where(updated, 0, state.since_update).astype(np.int32),
      probe_interval=np.where(updated, interval, state.probe_interval).astype(np.int32),
      baseline=np.where(updated, 0.0, state.baseline).astype(np.float32),
      calibrating=np.where(updated, config.calibration_windows, state.calibrating).astype(np.int32),
      regret_history=np.where(updated[:, None], np.nan, state.regret_history).astype(np.float32),
      consecutive=np.where(updated, 0, state.consecutive).astype(np.int32),
      cooldown=np.where(updated, config.cooldown, state.cooldown).astype(np.int32),
      updates=state.updates + (updated & kept), rollbacks=state.rollbacks + (updated & ~kept))
