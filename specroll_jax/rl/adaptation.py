"""What every learned proposer of a run (horizon heads, the sequential drafter) provides, and
the slow timescale they share: the monitor over per-depth verifier statistics, and
consolidation (or the always-online baseline) between rollout batches. Reflex, the fast
timescale, lives inside the engine's proposer.

A kind is a `LearnedProposerKind` (one thin file each: rl/head_adaptation.py,
rl/drafter_adaptation.py), registered by name in rl/learned_proposers.py; the run, the
rollouts and the memory report reach a kind only through that registry.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import struct

from specroll_jax.adapt import monitor
from specroll_jax.adapt.monitor import MonitorState

if TYPE_CHECKING:
  from specroll_jax.model.config import ModelConfig
  from specroll_jax.model.policy import Policy
  from specroll_jax.rl.run_config import AdaptationSection, RunConfig


@struct.dataclass
class ProposerState:
  """The learned proposer's state in a run (TrainState.heads): its parameters as the slow
  path adapted them, their optimizer state, and the slow path's monitor."""
  params: Any            # head params (dict) or DrafterParams
  opt_state: Any         # their optimizer state (consolidation.persistent_optimizer)
  monitor: MonitorState  # one watch per head or drafter depth


@dataclasses.dataclass(frozen=True)
class WarmStarted:
  """A learned proposer ready for a run: its static config, its warm-started parameters and
  the workdir directory that caches them."""
  config: Any            # HeadsConfig, DrafterConfig, ...
  params: Any
  directory: Path


@dataclasses.dataclass(frozen=True)
class ProposerMemory:
  """What a learned proposer adds to a device's memory: its parameters' shapes (a pytree of
  ShapeDtypeStructs) split by `rules` (model/mesh.py; () = replicated), times
  `copies` (the parameters and the slow path's AdamW moments)."""
  label: str
  shapes: Any
  rules: tuple
  copies: int = 3


class LearnedProposerKind(abc.ABC):
  """One kind of learned proposer: how a run warm-starts it, drafts with it, adapts it, and
  what memory it takes."""

  # Where a run's workdir caches its warm start (the kind's name in rollout.proposers).
  directory_name: str

  @property
  def supports_reflex(self) -> bool:
    """Whether Reflex (adaptation.mode reflex|both) can correct its drafts."""
    return False

  def check(self, config: RunConfig) -> None:
    """Raises a ValueError naming the field when `config` cannot run this kind."""

  @abc.abstractmethod
  def static_config(self, config: RunConfig) -> Any:
    """Its static config as `config` sets it (known before any warm start)."""

  @abc.abstractmethod
  def warm_start(self, policy: Policy, config: RunConfig, task_prompts, workdir: Path,
                 source: Path) -> WarmStarted:
    """Self-distilled on the initial policy's own answers to the task prompts (token ids),
    cached in the workdir; `source` names the policy it was distilled from."""

  @abc.abstractmethod
  def proposer(self, policy: Policy, config: RunConfig, warm: WarmStarted):
    """The engine's proposer (speculative/proposer.py) drafting with it."""

  @abc.abstractmethod
  def is_saved(self, directory: Path) -> bool:
    """Whether `directory` holds one of this kind (a warm start or experiments.train_heads)."""

  @abc.abstractmethod
  def load(self, policy: Policy, directory: Path) -> WarmStarted:
    """The saved one in `directory`; errors name the file and tensor at fault."""

  @abc.abstractmethod
  def drafting(self, policy: Policy, warm: WarmStarted, sampler, branching: tuple):
    """A static proposer drafting `branching` candidate ranks per depth, outside a run
    (experiments.generate)."""

  @abc.abstractmethod
  def adaptation(self, policy: Policy, config: RunConfig, warm: WarmStarted,
                 proposer) -> Adaptation:
    """Its slow path in the run."""

  @abc.abstractmethod
  def memory(self, model_config: ModelConfig, static_config) -> ProposerMemory:
    """Its part of the memory report."""


class Adaptation(abc.ABC):
  """`observe` reads the rollout's verifier feedback before the GRPO update and decides what
  to train; only then does the update harvest pairs (the harvest costs ~19% of a W1 update),
  so a slow-path step without a trigger pays nothing for the proposer. Subclasses give
  `init_state` and `train`. The monitor watches one window per depth of `branching`;
  `trainable` is the triggers' length (the heads, or the drafter's depths)."""

  def __init__(self, config: AdaptationSection, branching: tuple, proposer, trainable: int):
    self.mode, self.monitor_config = config.mode, config.monitor
    # The always-online baseline is tuned on its own (notes/history.md, issue 15).
    self.consolidation_config = config.retraining
    self.branching, self.proposer, self.trainable = branching, proposer, trainable

  @property
  def harvests(self) -> bool:
    return self.mode in ('online', 'slow', 'both')

  def init_monitor(self) -> MonitorState:
    return MonitorState.init(self.monitor_config, len(self.branching))

  def observe(self, state: ProposerState, responses):
    """Returns (state, triggered bool [trainable], metrics) after one rollout batch."""
    window = monitor.window_stats(
        [self.proposer.head_stats(r.stats.proposer) for r in responses], self.branching)
    metrics = {'head_acceptance': window.acceptance.round(4).tolist(),
               'head_regret': window.regret.round(4).tolist()}
    triggered = np.zeros(self.trainable, bool)
    if self.mode == 'online':
      triggered[:] = True
    elif self.harvests:
      watch, observed = monitor.observe(self.monitor_config, state.monitor, window)
      triggered[:len(observed)] = observed
      metrics['triggered'] = np.flatnonzero(observed).tolist()
      state = state.replace(monitor=watch)
    return state, triggered, metrics

  def consolidate(self, state: ProposerState, triggered, policy_params, pairs, groups, seed):
    """Trains what `triggered` names on the GRPO forward's harvest of the responses; `groups`
    are the rows' prompt indices. The pairs come from the pre-update policy's forward, so
    `policy_params` must be that policy's. Returns (state, metrics)."""
    params, opt_state, kept, metrics = self.train(state, triggered, policy_params, pairs,
                                                  groups, seed)
    watch = state.monitor
    if self.mode != 'online':
      watched = len(self.branching)
      watch = monitor.after_update(self.monitor_config, watch, triggered[:watched],
                                   kept[:watched])
      metrics['kept'] = np.flatnonzero(kept).tolist()
    state = ProposerState(params=params, opt_state=opt_state, monitor=watch)
    return jax.block_until_ready(state), metrics

  @abc.abstractmethod
  def init_state(self, params, mesh) -> ProposerState:
    """The state a run starts from, placed on `mesh`."""

  @abc.abstractmethod
  def train(self, state: ProposerState, triggered, policy_params, pairs, groups, seed):
    """Returns (params, optimizer state, kept bool [trainable], metrics)."""
