"""The sequential drafter in a GRPO run: its warm start, and its slow path.

The monitor watches the drafter's depths as it watches heads (acceptance and regret per
depth along the spine); any triggered depth trains the whole block, which every depth
shares (adapt/drafter_consolidation.py). The monitor then counts the update for the
triggered depths only, though the others' drafts changed too: a depth that did not trigger
keeps its baseline and goes on being judged against it. Reflex does not apply to the
drafter (speculative/drafter_proposer.py says why; run_config refuses it).
"""
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specroll_jax.adapt import drafter_consolidation
from specroll_jax.adapt.distill import WarmStart
from specroll_jax.adapt.drafter_training import warm_start_drafter
from specroll_jax.model.policy import Policy
from specroll_jax.rl.head_adaptation import Adaptation, HeadsState
from specroll_jax.rl.run_config import AdaptationSection, DrafterSection
from specroll_jax.speculative.drafter import (DrafterConfig, DrafterParams, has_drafter,
                                              load_drafter)


def warm_start_run_drafter(policy: Policy, d: DrafterSection, plan: WarmStart, task_prompts,
                           workdir: Path, source: Path):
  """A drafter self-distilled on the initial policy's own answers to the task prompts (token
  ids; cached in workdir/drafter); returns (config, params)."""
  directory = workdir / 'drafter'
  if not has_drafter(directory):
    print(f'warm-starting a drafter into {directory}', file=sys.stderr)
    warm_start_drafter(policy, d.model, d.training, task_prompts[:d.num_sequences + d.held_out],
                       plan, directory, str(source))
  return load_drafter(directory, policy.config)


class DrafterAdaptation(Adaptation):
  """The drafter's block, trained whole when any depth triggers."""

  def __init__(self, adaptation: AdaptationSection, drafter: DrafterSection, policy: Policy,
               config: DrafterConfig, proposer):
    super().__init__(adaptation, drafter.branching, proposer, config.depth)
    self.policy_config, self.drafter_config = policy.config, config
    self.training = drafter.training

  def init_state(self, params: DrafterParams, mesh) -> HeadsState:
    # A few MiB (SmolLM2: 2.0 M parameters): a copy on every device.
    params = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.device_put(
        drafter_consolidation.init_optimizer_state(self.consolidation_config, params),
        NamedSharding(mesh, P()))
    return HeadsState(params=params, opt_state=opt_state, monitor=self.init_monitor())

  def train(self, heads: HeadsState, triggered, policy_params, pairs, groups, seed):
    result = drafter_consolidation.consolidate(
        self.drafter_config, self.policy_config, self.training, self.consolidation_config,
        heads.params, heads.opt_state, policy_params, pairs, seed, groups=groups)
    metrics = {'drafter_loss': round(result.loss, 4)}
    if result.loss_before is not None:
      metrics.update(drafter_loss_before=result.loss_before.round(4).tolist(),
                     drafter_loss_after=result.loss_after.round(4).tolist())
    kept = np.asarray(triggered, bool) & result.kept
    return result.params, result.opt_state, kept, metrics
