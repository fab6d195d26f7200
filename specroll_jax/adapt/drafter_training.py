"""Self-distillation of a drafter (sequential or context-attending) on the policy's own
generations.

The pairs are the heads' (speculative/pairs.py): one policy forward over (prompt + response)
gives every position's hidden state h_t and the policy's top-K law of x_{t+1}. The drafter
is unrolled from h_t over the realised tokens, as it runs in the tree along its best
guesses (its config's `teacher_forced_states`: z_d = f(z_{d-1}, e(x_{t+d})) for the
sequential block; the context drafter's layer also attends over the entries before t, in
one parallel pass), and depth d is trained towards the policy's law at
t + d (that of x_{t+d+1}) by soft cross-entropy over the targets inside the draft
vocabulary. The walk accepts a draft at T = 1 with the policy's probability of it, so the
soft target is what the tree needs; a sampled token alone would train towards one draw.
Only the block's weights receive gradients.
"""
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specroll_jax.adapt.distill import WarmStart, generated_pairs, optax_loop
from specroll_jax.model.config import ModelConfig
from specroll_jax.model.transformer import Transformer
from specroll_jax.speculative.draft_vocabulary import frequency_vocabulary, vocabulary_index
from specroll_jax.speculative.drafter import (DrafterConfig, DrafterMetadata, DrafterParams,
                                              init_drafter, save_drafter)
from specroll_jax.speculative.pairs import DistillPairs, shifted


@dataclasses.dataclass(frozen=True)
class DrafterTraining:
  target_top_k: int = 32
  depth_decay: float = 0.8      # weight of depth d's loss: decay^(d-1)
  learning_rate: float = 2e-3
  batch_size: int = 16          # sequences (response spans) per step
  steps: int = 400
  # Weight of a feature loss (EAGLE's): depth d's state z_d regressed (smooth L1, mean over
  # the hidden size) onto the policy's own hidden state at t + d, whose projection is the
  # policy's law there. 0: the soft cross-entropy alone.
  feature_weight: float = 0.0


def _unrolled_states(config, model_config: ModelConfig, params: DrafterParams, policy_params,
                     batch: DistillPairs):
  """Each depth's teacher-forced state ([depth] of z_d [B, T, D]) and the policy's projection
  rows of the draft vocabulary [V_d, D]; `config` is any drafter kind's."""
  model = Transformer(model_config)
  draft_rows = model.apply({'params': policy_params}, params.vocab_ids, method=model.vocab_rows)
  embedded = model.apply({'params': policy_params}, batch.tokens, method=model.embed)
  states = config.teacher_forced_states(model_config, params.weights, batch.hidden, embedded,
                                        batch.valid)
  return states, draft_rows


def _unrolled_logits(config: DrafterConfig, model_config: ModelConfig, params: DrafterParams,
                     policy_params, batch: DistillPairs):
  """Draft-vocabulary log-probs of each depth, teacher-forced: [depth] of [B, T, V_d]."""
  return _log_probs(*_unrolled_states(config, model_config, params, policy_params, batch))


def _log_probs(states, draft_rows):
  return [jax.nn.log_softmax(z @ draft_rows.T, axis=-1) for z in states]


def _scored(batch: DistillPairs, d: int):
  """Depth d at t is scored where x_{t+d} is a real token (the policy's law at t + d exists)."""
  return batch.valid & shifted(batch.valid, d)


def _soft_cross_entropy(params: DrafterParams, logits, batch: DistillPairs):
  """Per depth (soft cross-entropy sum, positions) from the depths' log-probs."""
  losses, counts = [], []
  for d, logq in enumerate(logits, start=1):
    index, inside = vocabulary_index(params.vocab_ids, shifted(batch.target_ids, d))
    p = jnp.exp(shifted(batch.target_logp, d))
    ce = -jnp.sum(jnp.where(inside, p * jnp.take_along_axis(logq, index, axis=-1), 0.0), -1)
    mask = _scored(batch, d)
    losses.append(jnp.sum(jnp.where(mask, ce, 0.0)))
    counts.append(jnp.sum(mask))
  return jnp.stack(losses), jnp.stack(counts)


def depth_losses(config: DrafterConfig, model_config: ModelConfig, params: DrafterParams,
                 policy_params, batch: DistillPairs):
  """Per depth (soft cross-entropy sum, positions)."""
  return _soft_cross_entropy(
      params, _unrolled_logits(config, model_config, params, policy_params, batch), batch)


def _feature_losses(states, batch: DistillPairs):
  """Per depth, the smooth L1 distance of z_d to the policy's hidden state at t + d (the
  final one, the first part of pairs with layer features), summed over scored positions
  [depth]."""
  out = []
  final = batch.hidden[..., :states[0].shape[-1]]
  for d, z in enumerate(states, start=1):
    distance = jnp.mean(optax.huber_loss(z, shifted(final, d).astype(jnp.float32)), -1)
    out.append(jnp.sum(jnp.where(_scored(batch, d), distance, 0.0)))
  return jnp.stack(out)


@partial(jax.jit, static_argnums=(0, 1))
def feature_distances(config: DrafterConfig, model_config, params: DrafterParams, policy_params,
                      batch: DistillPairs):
  """Per depth, the mean smooth L1 distance of the teacher-forced z_d to the policy's hidden
  state at t + d [depth]."""
  states, _ = _unrolled_states(config, model_config, params, policy_params, batch)
  counts = jnp.stack([jnp.sum(_scored(batch, d)) for d in range(1, config.depth + 1)])
  return _feature_losses(states, batch) / jnp.maximum(counts, 1)


def drafter_loss(config: DrafterConfig, model_config, training: DrafterTraining, weights,
                 vocab_ids, policy_params, batch: DistillPairs):
  params = DrafterParams(weights=weights, vocab_ids=vocab_ids)
  states, draft_rows = _unrolled_states(config, model_config, params, policy_params, batch)
  loss, count = _soft_cross_entropy(params, _log_probs(states, draft_rows), batch)
  if training.feature_weight:
    loss = loss + training.feature_weight * _feature_losses(states, batch)
  decay = training.depth_decay ** jnp.arange(config.depth)
  return jnp.sum(decay * loss / jnp.maximum(count, 1)) / jnp.sum(decay)


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def train_step(config, model_config, training: DrafterTraining, optimizer, weights, opt_state,
               vocab_ids, policy_params, batch: DistillPairs):
  loss, grads = jax.value_and_grad(
      lambda w: drafter_loss(config, model_config, training, w, vocab_ids, policy_params,
                             batch))(weights)
  updates, opt_state = optimizer.update(grads, opt_state, weights)
  return optax.apply_updates(weights, updates), opt_state, loss


@partial(jax.jit, static_argnums=(0, 1))
def agreement(config: DrafterConfig, model_config, params: DrafterParams, policy_params,
              batch: DistillPairs):
  """Per depth, teacher-forced: (top-1 draft == the drawn x_{t+d+1} count, the policy's
  probability of the top-1 draft summed, positions). The second is the chance that the walk
  at T = 1 accepts the draft, at the depth's true context."""
  hits, mass, counts = [], [], []
  for d, logq in enumerate(_unrolled_logits(config, model_config, params, policy_params, batch),
                           start=1):
    best = params.vocab_ids[jnp.argmax(logq, axis=-1)]  # [B, T]
    targets, target_p = shifted(batch.target_ids, d), jnp.exp(shifted(batch.target_logp, d))
    p_best = jnp.sum(jnp.where(targets == best[..., None], target_p, 0.0), axis=-1)
    mask = batch.valid & shifted(batch.valid, d + 1)
    hits.append(jnp.sum(mask & (best == shifted(batch.tokens, d + 1))))
    mass.append(jnp.sum(jnp.where(mask, p_best, 0.0)))
    counts.append(jnp.sum(mask))
  return jnp.stack(hits), jnp.stack(mass), jnp.stack(counts)


@partial(jax.jit, static_argnums=(0, 1, 5))
def drawn_ranks(config: DrafterConfig, model_config, params: DrafterParams, policy_params,
                batch: DistillPairs, ranks: int):
  """int32 [B, T, depth]: the rank of the drawn x_{t+d+1} in depth d's teacher-forced law
  (`ranks` where it is below the top `ranks`, outside the draft vocabulary, or past the
  sequence). Along a path of drawn tokens the teacher-forced law is the one the drafter
  drafts from in the tree, so these ranks are the rank paths a T = 1 walk accepts."""
  out = []
  for d, logq in enumerate(_unrolled_logits(config, model_config, params, policy_params, batch),
                           start=1):
    index, inside = vocabulary_index(params.vocab_ids, shifted(batch.tokens, d + 1))
    rank = jnp.sum(logq > jnp.take_along_axis(logq, index[..., None], axis=-1), axis=-1)
    real = inside & batch.valid & shifted(batch.valid, d + 1)
    out.append(jnp.where(real & (rank < ranks), rank, ranks).astype(jnp.int32))
  return jnp.stack(out, axis=-1)


def agreement_rates(config, model_config, params, policy_params, held: DistillPairs):
  """(top-1 agreement [depth], top-1 policy mass [depth]) on held-out pairs."""
  hits, mass, counts = (np.asarray(x) for x in agreement(config, model_config, params,
                                                         policy_params, held))
  return hits / np.maximum(counts, 1), mass / np.maximum(counts, 1)


def vocabulary_coverage(vocab_ids, held: DistillPairs) -> float:
  """The share of held-out drawn tokens that the draft vocabulary holds: a ceiling on the
  drafter's agreement (the rest it can never draft)."""
  tokens, valid = np.asarray(held.tokens), np.asarray(held.valid)
  return float(np.mean(np.isin(tokens[:, 1:][valid[:, 1:]], np.asarray(vocab_ids))))


def train_drafter(policy, config: DrafterConfig, training: DrafterTraining, train: DistillPairs,
                  seed: int = 0, init_params: DrafterParams | None = None):
  """Optax training of the block alone over `train`; the draft vocabulary is the most
  frequent next tokens of `train` unless `init_params` brings one. Returns (params, loss)."""
  if init_params is None:
    vocab = frequency_vocabulary(train.tokens, train.valid, config.vocab_size(policy.config),
                                 policy.config.vocab_size)
    init_params = init_drafter(config, policy.config, vocab, seed)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(optax.cosine_decay_schedule(training.learning_rate,
                                                                  training.steps, 0.1)))
  vocab_ids = init_params.vocab_ids
  step = lambda weights, opt_state, batch: train_step(config, policy.config, training,
                                                      optimizer, weights, opt_state, vocab_ids,
                                                      policy.params, batch)
  weights, _, loss = optax_loop(step, init_params.weights, optimizer.init(init_params.weights),
                                train, training.steps, training.batch_size, seed,
                                'training drafter')
  return DrafterParams(weights=weights, vocab_ids=vocab_ids), loss


def warm_start_drafter(policy, config: DrafterConfig, training: DrafterTraining, prompts,
                       plan: WarmStart, directory, source: str):
  """Generates, trains and saves a drafter; returns (params, metadata)."""
  start = time.perf_counter()
  train, held = generated_pairs(policy, prompts, plan, training.target_top_k,
                                config.feature_layers)
  params, loss = train_drafter(policy, config, training, train, plan.seed)
  top1, mass = agreement_rates(config, policy.config, params, policy.params, held)
  metadata = DrafterMetadata(
      source=source, num_sequences=plan.num_sequences, positions=int(np.sum(train.valid)),
      steps=training.steps, final_loss=loss, seconds=time.perf_counter() - start,
      top1_by_depth=top1.tolist(), mass_by_depth=mass.tolist(),
      vocab_coverage=vocabulary_coverage(params.vocab_ids, held))
  save_drafter(directory, config, params, metadata)
  return params, metadata
