"""The learned proposer's slow timescale between rollout batches: monitor + consolidation,
or the always-online baseline. Reflex (the fast timescale) lives inside the engine's proposer.

`Adaptation` holds what the heads and the sequential drafter share (the monitor over the
proposer's per-depth verifier statistics, the modes); `HeadAdaptation` trains horizon heads,
rl/drafter_adaptation.py the drafter's block.
"""
import abc
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import struct

from specroll_jax.adapt import consolidation, monitor
from specroll_jax.adapt.distill import DistillConfig, WarmStart, ensure_heads
from specroll_jax.adapt.monitor import MonitorState
from specroll_jax.model.mesh import head_sharding, optimizer_sharding
from specroll_jax.model.policy import Policy
from specroll_jax.rl.run_config import AdaptationSection, HeadsSection
from specroll_jax.speculative.heads import HeadsConfig


@struct.dataclass
class HeadsState:
  """The learned proposer's state in a run (TrainState.heads): horizon heads or a drafter."""
  params: Any            # head params (dict) or DrafterParams, as the slow path adapted them
  opt_state: Any         # their optimizer state (consolidation.persistent_optimizer)
  monitor: MonitorState  # the slow path's monitor, one watch per head or drafter depth


def warm_start_heads(policy: Policy, h: HeadsSection, plan: WarmStart, task_prompts,
                     workdir: Path, source: Path):
  """Heads self-distilled on the initial policy's own answers to the task prompts (token
  ids; cached in workdir/heads); returns (heads config, params, directory)."""
  directory = workdir / 'heads'
  prompts = task_prompts[:h.num_sequences + h.held_out]
  heads_config, params = ensure_heads(policy, HeadsConfig(h.num_heads),
                                      DistillConfig(steps=h.steps, batch_size=h.batch_size,
                                                    draft_vocab_size=h.draft_vocab_size),
                                      prompts, plan, directory, str(source))
  return heads_config, params, directory


class Adaptation(abc.ABC):
  """`observe` reads the rollout's verifier feedback before the GRPO update and decides what
  to train; only then does the update harvest pairs (the harvest costs ~19% of a W1 update),
  so a slow-path step without a trigger pays nothing for the proposer. Subclasses give
  `init_state` and `train`. The monitor watches one window per depth of `branching`;
  `trainable` is the triggers' length (the heads, or the drafter's depths)."""

  def __init__(self, config: AdaptationSection, branching: tuple, proposer, trainable: int):
    self.mode, self.monitor_config = config.mode, config.monitor
    # The always-online baseline is tuned on its own (WORKSPACE_NOTES, issue 15).
    self.consolidation_config = config.retraining
    self.branching, self.proposer, self.trainable = branching, proposer, trainable

  @property
  def harvests(self) -> bool:
    return self.mode in ('online', 'slow', 'both')

  def init_monitor(self) -> MonitorState:
    return MonitorState.init(self.monitor_config, len(self.branching))

  def observe(self, heads: HeadsState, responses):
    """Returns (heads, triggered bool [trainable], metrics) after one rollout batch."""
    window = monitor.window_stats(
        [self.proposer.head_stats(r.stats.proposer) for r in responses], self.branching)
    metrics = {'head_acceptance': window.acceptance.round(4).tolist(),
               'head_regret': window.regret.round(4).tolist()}
    triggered = np.zeros(self.trainable, bool)
    if self.mode == 'online':
      triggered[:] = True
    elif self.harvests:
      watch, observed = monitor.observe(self.monitor_config, heads.monitor, window)
      triggered[:len(observed)] = observed
      metrics['triggered'] = np.flatnonzero(observed).tolist()
      heads = heads.replace(monitor=watch)
    return heads, triggered, metrics

  def consolidate(self, heads: HeadsState, triggered, policy_params, pairs, groups, seed):
    """Trains what `triggered` names on the GRPO forward's harvest of the responses; `groups`
    are the rows' prompt indices. The pairs come from the pre-update policy's forward, so
    `policy_params` must be that policy's. Returns (heads, metrics)."""
    params, opt_state, kept, metrics = self.train(heads, triggered, policy_params, pairs,
                                                  groups, seed)
    watch = heads.monitor
    if self.mode != 'online':
      watched = len(self.branching)
      watch = monitor.after_update(self.monitor_config, watch, triggered[:watched],
                                   kept[:watched])
      metrics['kept'] = np.flatnonzero(kept).tolist()
    heads = HeadsState(params=params, opt_state=opt_state, monitor=watch)
    return jax.block_until_ready(heads), metrics

  @abc.abstractmethod
  def init_state(self, params, mesh) -> HeadsState:
    """The state a run starts from, placed on `mesh`."""

  @abc.abstractmethod
  def train(self, heads: HeadsState, triggered, policy_params, pairs, groups, seed):
    """Returns (params, optimizer state, kept bool [trainable], metrics)."""


class HeadAdaptation(Adaptation):
  """Each triggered head trains alone (adapt/consolidation.py)."""

  def __init__(self, config: AdaptationSection, policy: Policy, heads_config: HeadsConfig,
               branching: tuple, proposer):
    super().__init__(config, branching, proposer, heads_config.num_heads)
    self.policy_config, self.heads_config = policy.config, heads_config

  def init_state(self, params, mesh) -> HeadsState:
    config = self.consolidation_config
    params = jax.device_put(params, head_sharding(mesh, params))
    opt_state = consolidation.init_optimizer_state(config, params)
    opt_state = jax.device_put(opt_state, optimizer_sharding(
        mesh, consolidation.make_optimizer(config), opt_state, head_sharding(mesh, params)))
    return HeadsState(params=params, opt_state=opt_state, monitor=self.init_monitor())

  def train(self, heads: HeadsState, triggered, policy_params, pairs, groups, seed):
    result = consolidation.consolidate(self.heads_config, self.policy_config,
                                       self.consolidation_config, heads.params, heads.opt_state,
                                       policy_params, pairs, triggered, seed, groups=groups)
    metrics = {}
    if result.kl_before is not None:
      metrics.update(head_kl_before=result.kl_before.round(4).tolist(),
                     head_kl_after=result.kl_after.round(4).tolist())
    return result.params, result.opt_state, result.kept, metrics
