"""The drafters as a run's learned proposers (the sequential one, and the context-attending
one: the same section, warm start, spine and slow path, with a different layer and cache):
their warm start, their spine, and their slow path.

The monitor watches the drafter's depths as it watches heads (acceptance and regret per
depth along the spine, or along each row's most probable path in a tree grown per row); any
triggered depth trains the whole block, which every depth shares
(adapt/drafter_consolidation.py). The monitor then counts the update for the
triggered depths only, though the others' drafts changed too: a depth that did not trigger
keeps its baseline and goes on being judged against it. Reflex does not apply to the
drafter (speculative/drafter_proposer.py says why).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specroll_jax.adapt import drafter_consolidation
from specroll_jax.adapt.drafter_training import warm_start_drafter
from specroll_jax.rl.adaptation import (Adaptation, LearnedProposerKind, ProposerMemory,
                                        ProposerState, WarmStarted)
from specroll_jax.speculative.context_drafter import ContextDrafterConfig
from specroll_jax.speculative.context_drafter_proposer import ContextDrafterProposer
from specroll_jax.speculative.drafter import (DrafterConfig, DrafterParams, has_drafter,
                                              init_drafter, load_drafter)
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths

if TYPE_CHECKING:
  from specroll_jax.model.config import ModelConfig
  from specroll_jax.model.policy import Policy
  from specroll_jax.rl.run_config import AdaptationSection, DrafterSection, RunConfig


class DrafterKind(LearnedProposerKind):
  """config.drafter: the block, its warm start and its spine's branching."""
  config_type = DrafterConfig
  proposer_type = DrafterProposer
  directory_name = 'drafter'

  def check(self, config: RunConfig) -> None:
    config.drafter.check()

  def static_config(self, config: RunConfig) -> DrafterConfig:
    return config.drafter.model

  def warm_start(self, policy: Policy, config: RunConfig, task_prompts, workdir: Path,
                 source: Path) -> WarmStarted:
    d, directory = config.drafter, workdir / self.directory_name
    if not self.is_saved(directory):
      print(f'warm-starting a {self.directory_name} into {directory}', file=sys.stderr)
      warm_start_drafter(policy, self.static_config(config), d.training,
                         task_prompts[:d.num_sequences + d.held_out],
                         config.warm_start_plan(d.num_sequences, d.held_out), directory,
                         str(source))
    return self.load(policy, directory)

  def proposer(self, policy: Policy, config: RunConfig, warm: WarmStarted):
    """The spine of drafter.branching, grown best-first per row where drafter.expanded asks."""
    spine = self.drafting(policy, warm, config.rollout.sampler, config.drafter.branching)
    return dataclasses.replace(spine, expanded=config.drafter.expanded)

  def is_saved(self, directory: Path) -> bool:
    return has_drafter(directory, self.config_type)

  def load(self, policy: Policy, directory: Path) -> WarmStarted:
    drafter_config, params = load_drafter(directory, policy.config, self.config_type)
    return WarmStarted(drafter_config, params, Path(directory))

  def drafting(self, policy: Policy, warm: WarmStarted, sampler, branching: tuple):
    return self.proposer_type(policy.config, warm.config, spine_paths(tuple(branching)),
                              sampler)

  def adaptation(self, policy: Policy, config: RunConfig, warm: WarmStarted,
                 proposer) -> DrafterAdaptation:
    return DrafterAdaptation(config.adaptation, config.drafter, policy, warm.config, proposer)

  def memory(self, model_config: ModelConfig, static_config: DrafterConfig) -> ProposerMemory:
    shapes = jax.eval_shape(lambda: init_drafter(
        static_config, model_config,
        jnp.zeros(static_config.vocab_size(model_config), jnp.int32)).weights)
    # Replicated (DrafterAdaptation.init_state).
    return ProposerMemory('drafter block + its optimizer', shapes, ())


class ContextDrafterKind(DrafterKind):
  """config.drafter as well, its block a decoder layer of drafter.context_heads heads over the
  response's cached entries (speculative/context_drafter.py)."""
  config_type = ContextDrafterConfig
  proposer_type = ContextDrafterProposer
  directory_name = 'context_drafter'

  def check(self, config: RunConfig) -> None:
    super().check(config)
    try:
      self.static_config(config)
    except ValueError as error:
      raise ValueError(f'config drafter.model: {error}') from None

  def static_config(self, config: RunConfig) -> ContextDrafterConfig:
    return ContextDrafterConfig.from_block(config.drafter.model, config.drafter.context_heads)


class DrafterAdaptation(Adaptation):
  """The drafter's block, trained whole when any depth triggers."""

  def __init__(self, adaptation: AdaptationSection, drafter: DrafterSection, policy: Policy,
               config: DrafterConfig, proposer):
    super().__init__(adaptation, drafter.branching, proposer, config.depth)
    self.policy_config, self.drafter_config = policy.config, config
    self.training = drafter.training

  def init_state(self, params: DrafterParams, mesh) -> ProposerState:
    # A few MiB (SmolLM2: 2.0 M parameters): a copy on every device.
    params = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.device_put(
        drafter_consolidation.init_optimizer_state(self.consolidation_config, params),
        NamedSharding(mesh, P()))
    return ProposerState(params=params, opt_state=opt_state, monitor=self.init_monitor())

  def train(self, state: ProposerState, triggered, policy_params, pairs, groups, seed):
    result = drafter_consolidation.consolidate(
        self.drafter_config, self.policy_config, self.training, self.consolidation_config,
        state.params, state.opt_state, policy_params, pairs, seed, groups=groups)
    metrics = {'drafter_loss': round(result.loss, 4)}
    if result.loss_before is not None:
      metrics.update(drafter_loss_before=result.loss_before.round(4).tolist(),
                     drafter_loss_after=result.loss_after.round(4).tolist())
    kept = np.asarray(triggered, bool) & result.kept
    return result.params, result.opt_state, kept, metrics
