"""Horizon heads as a run's learned proposer: their warm start, drafting (static, or
corrected by Reflex inside the engine's step) and their slow path, where each triggered
head trains alone (adapt/consolidation.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax

from specroll_jax.adapt import consolidation
from specroll_jax.adapt.distill import DistillConfig, ensure_heads
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.model.mesh import HEAD_RULES, head_sharding, optimizer_sharding
from specroll_jax.rl.adaptation import (Adaptation, LearnedProposerKind, ProposerMemory,
                                        ProposerState, WarmStarted)
from specroll_jax.speculative.factory import head_proposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.heads import HeadsConfig, HorizonHeads, has_heads, load_heads

if TYPE_CHECKING:
  from specroll_jax.model.config import ModelConfig
  from specroll_jax.model.policy import Policy
  from specroll_jax.rl.run_config import AdaptationSection, RunConfig


class HeadsKind(LearnedProposerKind):
  """config.heads: the warm start; config.rollout.head_drafts: the trees they draft."""

  directory_name = 'heads'

  @property
  def supports_reflex(self) -> bool:
    return True

  def static_config(self, config: RunConfig) -> HeadsConfig:
    return HeadsConfig(config.heads.num_heads)

  def warm_start(self, policy: Policy, config: RunConfig, task_prompts, workdir: Path,
                 source: Path) -> WarmStarted:
    h, directory = config.heads, workdir / self.directory_name
    heads_config, params = ensure_heads(
        policy, self.static_config(config),
        DistillConfig(steps=h.steps, batch_size=h.batch_size,
                      draft_vocab_size=h.draft_vocab_size),
        task_prompts[:h.num_sequences + h.held_out],
        config.warm_start_plan(h.num_sequences, h.held_out), directory, str(source))
    return WarmStarted(heads_config, params, directory)

  def proposer(self, policy: Policy, config: RunConfig, warm: WarmStarted):
    proposer = head_proposer(policy, warm.config, warm.directory, config.rollout.sampler,
                             config.rollout.head_drafts)
    if config.adaptation.mode in ('reflex', 'both'):
      proposer = ReflexProposer(proposer, config.adaptation.reflex)
    return proposer

  def is_saved(self, directory: Path) -> bool:
    return has_heads(directory)

  def load(self, policy: Policy, directory: Path) -> WarmStarted:
    heads_config, params = load_heads(directory, policy.config)
    return WarmStarted(heads_config, params, Path(directory))

  def drafting(self, policy: Policy, warm: WarmStarted, sampler, branching: tuple):
    return head_proposer(policy, warm.config, warm.directory, sampler,
                         HeadDraftConfig(tuple(branching)))

  def adaptation(self, policy: Policy, config: RunConfig, warm: WarmStarted,
                 proposer) -> HeadAdaptation:
    return HeadAdaptation(config.adaptation, policy, warm.config,
                          config.rollout.head_drafts.branching, proposer)

  def memory(self, model_config: ModelConfig, static_config: HeadsConfig) -> ProposerMemory:
    shapes = jax.eval_shape(lambda: HorizonHeads(static_config, model_config).init(
        jax.random.key(0), jax.numpy.zeros((1, model_config.hidden_size)))['params'])
    return ProposerMemory('heads + their optimizer', shapes, HEAD_RULES)


class HeadAdaptation(Adaptation):
  """Each triggered head trains alone (adapt/consolidation.py)."""

  def __init__(self, config: AdaptationSection, policy: Policy, heads_config: HeadsConfig,
               branching: tuple, proposer):
    super().__init__(config, branching, proposer, heads_config.num_heads)
    self.policy_config, self.heads_config = policy.config, heads_config

  def init_state(self, params, mesh) -> ProposerState:
    config = self.consolidation_config
    params = jax.device_put(params, head_sharding(mesh, params))
    opt_state = consolidation.init_optimizer_state(config, params)
    opt_state = jax.device_put(opt_state, optimizer_sharding(
        mesh, consolidation.make_optimizer(config), opt_state, head_sharding(mesh, params)))
    return ProposerState(params=params, opt_state=opt_state, monitor=self.init_monitor())

  def train(self, state: ProposerState, triggered, policy_params, pairs, groups, seed):
    result = consolidation.consolidate(self.heads_config, self.policy_config,
                                       self.consolidation_config, state.params, state.opt_state,
                                       policy_params, pairs, triggered, seed, groups=groups)
    metrics = {}
    if result.kl_before is not None:
      metrics.update(head_kl_before=result.kl_before.round(4).tolist(),
                     head_kl_after=result.kl_after.round(4).tolist())
    return result.params, result.opt_state, result.kept, metrics
