"""The GRPO learner of a run: batches from rollouts, and one update for full and LoRA training.

Everything needed to resume bit for bit is a `TrainState` (policy, optimizer state, heads
and the slow path's monitor, step, data position), saved as one Orbax checkpoint per step.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from specroll_jax.model.mesh import (optimizer_sharding, param_sharding, put_rows, shard_params,
                                     to_host)
from specroll_jax.model.policy import Policy
from specroll_jax.rl import grpo, lora
from specroll_jax.rl.adaptation import ProposerState


@struct.dataclass
class TrainState:
  """Everything a run resumes from (one Orbax checkpoint per saved step)."""
  policy: dict               # with LoRA, the frozen base
  opt_state: Any             # of the policy, or of the adapters
  step: int
  data_position: int         # index of the next task in the (cycled) task list
  heads: ProposerState | None  # the learned proposer's; None when none drafts
  adapters: dict | None = None  # LoRA adapters (grpo.lora_rank > 0)


class Learner:
  """GRPO on the run's one learner width, the policy's arrays sharded once by the mesh.

  The update that also returns head-training pairs (the last prompt position and the
  response: every pair whose horizon lies in the response) is a second compiled program,
  run only on the steps whose heads were triggered.
  """

  def __init__(self, config: grpo.GRPOConfig, policy: Policy, width: int, mesh, *,
               harvest_top_k: int, harvest_feature_layers: tuple, drift_kl_every: int,
               seed: int):
    self.model_config, self.width, self.mesh = policy.config, width, mesh
    self.config = config
    # The harvest's span is the loss's: one projection serves both. Its pairs carry the
    # layer features the learned proposer reads (none for heads).
    self.harvest_config = dataclasses.replace(config, harvest_top_k=harvest_top_k,
                                              harvest_span=config.score_span,
                                              harvest_feature_layers=harvest_feature_layers)
    self.optimizer = grpo.make_optimizer(self.config)
    # One copy of every array, sharded by the mesh's rules: rollouts and learner share it.
    self.initial_policy = shard_params(mesh, policy.params)
    self.reference = self.initial_policy if self.config.kl_coef > 0 else None
    # Read after the first update (the KL term's reference, the drift KL), so the trained
    # policy, whose buffers each update reuses, starts as a copy of it.
    self.keeps_initial_policy = self.reference is not None or drift_kl_every > 0
    self.seed = seed

  def init_state(self, heads: ProposerState | None) -> TrainState:
    adapters = None
    if self.config.lora_rank:
      adapters = shard_params(self.mesh, lora.init_adapters(
          self.initial_policy, self.config.lora_rank, self.config.lora_targets, self.seed))
    policy = self.initial_policy
    if adapters is None and self.keeps_initial_policy:
      policy = jax.tree.map(jnp.copy, policy)
    trained = policy if adapters is None else adapters
    opt_state = self.optimizer.init(trained)
    opt_state = jax.device_put(opt_state, optimizer_sharding(
        self.mesh, self.optimizer, opt_state, param_sharding(self.mesh, trained)))
    return TrainState(policy=policy, opt_state=opt_state, step=0, data_position=0,
                      heads=heads, adapters=adapters)

  def rollout_params(self, state: TrainState):
    """The policy the rollouts sample (with LoRA: merged once per step)."""
    if state.adapters is None:
      return state.policy
    return lora.merge_jit(state.policy, state.adapters, self.config.lora_scale)

  def batch(self, prompts, responses, scores) -> grpo.RolloutBatch:
    """The rollout as a learner batch on the mesh: group advantages, and the reference
    policy's log-probs when the loss has a KL term."""
    longest = max(len(r.token_ids) for r in responses)
    if longest >= self.config.score_span:
      raise ValueError(f'a response of {longest} tokens: the loss scores at most '
                       f'{self.config.score_span - 1} per row (rollout.driver.max_new_tokens)')
    batch = grpo.batch_from_rollouts(
        [prompts[r.prompt_index] for r in responses], [r.token_ids for r in responses],
        [r.logprobs for r in responses],
        grpo.group_advantages(scores, self.config.group_size, self.config.advantage_eps),
        self.width)
    batch = jax.tree.map(lambda x: put_rows(self.mesh, x), batch)
    if self.reference is not None:
      batch = batch.replace(ref_logprobs=grpo.token_logprobs(
          self.model_config, self.reference, batch.tokens, self.config.temperature,
          self.config.stream_logits))
    return jax.block_until_ready(batch)

  def update(self, state: TrainState, batch: grpo.RolloutBatch, harvest: bool):
    """One AdamW step of the policy (or of its LoRA adapters over the frozen base).
    Returns (state, metrics, head-training pairs or None).

    The trained arrays and their optimizer state in `state` are donated to the update (its
    outputs reuse their buffers) except on harvest steps, whose heads then consolidate
    against the policy the pairs came from.
    """
    lora_run = state.adapters is not None
    train_step = grpo.train_step if harvest else grpo.train_step_in_place
    params, opt_state, metrics, pairs = train_step(
        self.model_config, self.harvest_config if harvest else self.config,
        state.adapters if lora_run else state.policy, state.opt_state, batch,
        state.policy if lora_run else None, mesh=self.mesh)
    jax.block_until_ready(params)
    metrics = {k: float(v) for k, v in metrics.items()}
    if metrics['update_skipped']:
      logging.warning('step %d: non-finite GRPO loss %s or gradient norm %s; the policy '
                      'update was rolled back (metrics: update_skipped)', state.step + 1,
                      metrics['loss'], metrics['grad_norm'])
    trained = {'adapters' if lora_run else 'policy': params}
    return state.replace(opt_state=opt_state, **trained), metrics, pairs

  def drift_kl(self, batch: grpo.RolloutBatch) -> float:
    """KL(pi_current || pi_initial) estimated on the rollout's own tokens (sampled from the
    current policy): the mean of log pi_current - log pi_initial over response tokens."""
    current, initial, mask = to_host((
        batch.old_logprobs,
        grpo.token_logprobs(self.model_config, self.initial_policy, batch.tokens,
                            self.config.temperature, self.config.stream_logits),
        batch.response_mask))
    return float(np.sum(np.where(mask, current - initial, 0.0)) / max(mask.sum(), 1))
