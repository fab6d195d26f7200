"""GRPO core: group advantages, the clipped token-level surrogate, and the policy update.

A batch holds P prompts x G responses as rows of (prompt + response), right padded with -1.
Position t of a row carries the log-prob of token t given tokens[:t], so the behaviour
log-probs a rollout engine returns (Response.logprobs) line up with the learner's
recomputed ones (`token_logprobs`) index for index.

The loss is a weighted sum over tokens, sum_{b,t} w[b,t] * loss[b,t], with the weights
fixed by the whole batch (`loss_weights`): token-mean gives every response token of the
batch 1/N, sequence-mean gives each token 1/(its sequence's length * number of sequences).
Because the weights come from the whole batch, the losses (and gradients and metrics) of
micro-batches add up to the full batch's (up to float32 summation order), which makes
gradient accumulation in `train_step` exact for either aggregation.
"""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from specroll_jax.model import invariant
from specroll_jax.model.config import ModelConfig
from specroll_jax.model.mesh import ROWS, optimizer_sharding, param_sharding
from specroll_jax.model.transformer import Transformer, final_hidden, padded_sequence_hidden
from specroll_jax.model.vocab_chunks import map_projected
from specroll_jax.rl import lora
from specroll_jax.speculative.pairs import DistillPairs, span_positions, take_positions, top_targets

AGGREGATIONS = ('token-mean', 'sequence-mean')


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Hashable (a jit static argument).

  kl_coef 0 = no reference KL term. temperature is the rollout sampler's: log-probs are
  scored under softmax(logits / temperature) as the sampler reports them (0 = greedy
  rollouts, scored at 1). advantage_eps keeps a group whose rewards are all equal at
  advantage 0 instead of 0/0.
  """
  group_size: int = 8
  clip_epsilon_low: float = 0.2
  clip_epsilon_high: float = 0.2
  kl_coef: float = 0.0
  loss_aggregation: str = 'token-mean'
  temperature: float = 1.0
  learning_rate: float = 1e-6
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  micro_batch_size: int = 8
  advantage_eps: float = 1e-6
  harvest_top_k: int = 0  # > 0: also return head-training pairs from the update's forward
  # > 0: harvest only each row's positions [last prompt position, + harvest_span), the
  # pairs whose horizon lies in the response; 0: whole rows.
  harvest_span: int = 0
  # Decoder layers whose outputs widen the harvested pairs' hidden states, after the final
  # one: a drafter's that fuses layer features (speculative/drafter.py); (): h_t alone.
  harvest_feature_layers: tuple = ()
  # > 0: project onto the vocabulary only each row's positions [last prompt position,
  # + score_span), the predictions of its response tokens; the prompt's and the padding's
  # are never read by the loss (on the SmolLM2 job they are 5 of every 9 positions). The
  # learner sets max_new_tokens + 1; a response longer than score_span - 1 is an error there.
  score_span: int = 0
  # True: pi_old is the learner's own forward at the step's starting parameters (exact for
  # one update per batch, as train_step does), not the rollout engine's log-probs, so
  # training does not depend on the engine's float32 rounding (1e-5, shape dependent).
  learner_old_logprobs: bool = True
  # LoRA (rl/lora.py): rank 0 trains every parameter; rank r > 0 trains only adapters on
  # the kernels of the comma-separated module names in lora_targets.
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: str = lora.DEFAULT_TARGETS
  # True: the loss projects onto the vocabulary a chunk of positions at a time, and again
  # in the backward pass (`_streamed_token_scores`): memory for one more projection's time.
  stream_logits: bool = False

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank

  def __post_init__(self):
    # A static argument of the compiled update: hashable, whatever sequence it was given.
    object.__setattr__(self, 'harvest_feature_layers',
                       tuple(int(i) for i in self.harvest_feature_layers))
    if self.group_size < 1:
      raise ValueError(f'group_size must be >= 1, got {self.group_size}')
    if not 0.0 <= self.clip_epsilon_low < 1.0:
      raise ValueError(f'clip_epsilon_low must be in [0, 1), got {self.clip_epsilon_low}')
    if self.clip_epsilon_high < 0:
      raise ValueError(f'clip_epsilon_high must be >= 0, got {self.clip_epsilon_high}')
    if self.kl_coef < 0:
      raise ValueError(f'kl_coef must be >= 0, got {self.kl_coef}')
    if self.loss_aggregation not in AGGREGATIONS:
      raise ValueError(f'loss_aggregation must be one of {AGGREGATIONS}, '
                       f'got {self.loss_aggregation!r}')
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if self.learning_rate <= 0:
      raise ValueError(f'learning_rate must be > 0, got {self.learning_rate}')
    if self.weight_decay < 0:
      raise ValueError(f'weight_decay must be >= 0, got {self.weight_decay}')
    if self.max_grad_norm <= 0:
      raise ValueError(f'max_grad_norm must be > 0, got {self.max_grad_norm}')
    if self.micro_batch_size < 1:
      raise ValueError(f'micro_batch_size must be >= 1, got {self.micro_batch_size}')
    if self.advantage_eps <= 0:
      raise ValueError(f'advantage_eps must be > 0, got {self.advantage_eps}')
    if self.harvest_top_k < 0 or self.harvest_span < 0 or self.score_span < 0:
      raise ValueError(f'harvest_top_k, harvest_span and score_span must be >= 0, got '
                       f'{self.harvest_top_k}, {self.harvest_span} and {self.score_span}')
    if self.lora_rank < 0:
      raise ValueError(f'lora_rank must be >= 0, got {self.lora_rank}')
    if self.lora_rank and not lora.target_names(self.lora_targets):
      raise ValueError(f'lora_targets names no module: {self.lora_targets!r}')


def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> jax.Array:
  """A_i = (r_i - mean(r_group)) / (std(r_group) + eps) for rewards [P * G] -> [P * G].

  Rewards are ordered prompt-major (row r = p * G + s, as the rollout driver returns them).
  std is the population std (ddof=0): defined for any G >= 1 (a group of one gets A = 0).
  The sample std (ddof=1, e.g. TRL's torch .std()) is sqrt(G / (G - 1)) times larger, so
  these advantages are that factor larger: a constant rescaling of the policy-gradient term
  that Adam nearly ignores, though it shifts the balance against kl_coef by the same factor.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(f'rewards must be a flat [P * G] array with G={group_size}, '
                     f'got shape {rewards.shape}')
  groups = rewards.reshape(-1, group_size)
  mean = jnp.mean(groups, axis=1, keepdims=True)
  std = jnp.std(groups, axis=1, keepdims=True)
  return ((groups - mean) / (std + eps)).reshape(-1)


@struct.dataclass
class RolloutBatch:
  tokens: jax.Array         # int32 [B, T] prompt + response, right padded with -1
  response_mask: jax.Array  # bool [B, T] token t was generated by the policy (scored)
  old_logprobs: jax.Array   # float32 [B, T] behaviour log-prob of token t; 0 off the mask
  advantages: jax.Array     # float32 [B] one per sequence
  ref_logprobs: jax.Array | None = None  # float32 [B, T] reference log-prob of token t


def batch_from_rollouts(prompts: list[list[int]], responses: list[list[int]],
                       logprobs: list[list[float]], advantages, width: int) -> RolloutBatch:
  """Packs row i = prompts[i] + responses[i] into a [B, width] batch.

  logprobs[i] are the rollout's own log-probs of responses[i] (the behaviour policy when
  learner_old_logprobs is off). For a reference KL term, set
  `ref_logprobs=token_logprobs(config, ref_params, batch.tokens, T)` with `batch.replace`.
  """
  advantages = np.asarray(advantages, np.float32)
  rows = len(responses)
  if not len(prompts) == len(logprobs) == rows:
    raise ValueError(f'{len(prompts)} prompts, {rows} responses and {len(logprobs)} '
                     'log-prob rows: one of each per row')
  if advantages.shape != (rows,):
    raise ValueError(f'advantages has shape {advantages.shape}, expected ({rows},)')
  tokens = np.full((rows, width), -1, np.int32)
  mask = np.zeros((rows, width), bool)
  old = np.zeros((rows, width), np.float32)
  for i, (prompt, response, logp) in enumerate(zip(prompts, responses, logprobs)):
    end = len(prompt) + len(response)
    if end > width:
      raise ValueError(f'row {i} needs {end} positions but width is {width}')
    if len(logp) != len(response):
      raise ValueError(f'row {i} has {len(response)} tokens but {len(logp)} log-probs')
    tokens[i, :end] = list(prompt) + list(response)
    mask[i, len(prompt):end] = True
    old[i, len(prompt):end] = logp
  return RolloutBatch(tokens=jnp.asarray(tokens), response_mask=jnp.asarray(mask),
                      old_logprobs=jnp.asarray(old), advantages=jnp.asarray(advantages))


def _project(config: ModelConfig, params, hidden):
  return Transformer(config).apply({'params': params}, hidden, method=Transformer.project)


def _token_scores(logits, targets, scale: float):
  """log softmax(logits / scale) at `targets` and that law's entropy (no gradient)."""
  logp_all = invariant.log_softmax(logits / scale)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  law = jax.lax.stop_gradient(logp_all)
  return logp, -jnp.sum(jnp.exp(law) * law, axis=-1)


def _streamed_token_scores(config: ModelConfig, params, hidden, targets, scale: float):
  """`_token_scores` of hidden [B, S, D] at targets int32 [B, S], [B, S] each, projecting a
  chunk of positions at a time and again in the backward pass
  (`vocab_chunks.map_projected`), so at most one chunk's logits, log-softmax and gradient
  are live; every position's at once are several copies of 0.1 GB per row of 540 positions
  at V = 49,152. The cost is one more projection per position.
  """
  rows, length = targets.shape
  flat = lambda x: x.reshape(rows * length, *x.shape[2:])
  logp, entropy = map_projected(config, params, flat(hidden),
                                partial(_token_scores, scale=scale), flat(targets))
  return logp.reshape(rows, length), entropy.reshape(rows, length)


def _scored_forward(config: ModelConfig, params, tokens, temperature: float,
                    harvest_top_k: int = 0, harvest_span: int = 0, starts=None,
                    stream_logits: bool = False, score_span: int = 0,
                    harvest_feature_layers: tuple = ()):
  """log pi(tokens[:, t] | tokens[:, :t]) and the entropy of that distribution, [B, T] each,
  and, when harvest_top_k > 0, the slow path's head-training pairs from this same forward
  (hidden states, widened with the outputs of `harvest_feature_layers`, and the policy's
  top-K next-token distribution; else None): over whole rows, or with harvest_span > 0 over
  positions [starts, + harvest_span) per row, which takes the top-K of those positions only.

  With score_span > 0 only positions [starts, + score_span) are projected, so only tokens
  starts + 1 .. starts + score_span are scored. Index 0, padding and unscored tokens hold 0.
  The scaling is the sampler's (sampling.token_logprob): softmax(logits / T), T = 1 for
  greedy, before any top-k/top-p filtering.
  """
  features, safe, valid = padded_sequence_hidden(
      config, params, tokens, harvest_feature_layers if harvest_top_k else ())
  hidden = final_hidden(config, features)
  rows, width = tokens.shape
  scale = 1.0 if temperature == 0 else temperature
  # Position t predicts token t + 1; the last position predicts nothing in the batch.
  if score_span:
    scored, scored_inside = span_positions(starts, score_span, width)
    scored_hidden = take_positions(hidden, scored)
    targets = take_positions(jnp.pad(safe[:, 1:], ((0, 0), (0, 1))), scored)
  else:
    scored_hidden, targets = hidden[:, :-1], safe[:, 1:]
  logits = None
  if stream_logits:
    logp, entropy = _streamed_token_scores(config, params, scored_hidden, targets, scale)
  else:
    logits = _project(config, params, scored_hidden)
    logp, entropy = _token_scores(logits, targets, scale)
  if score_span:
    # Back to token positions; a span running past the row lands past it and is dropped.
    place = lambda x: jnp.zeros((rows, width), x.dtype).at[
        jnp.arange(rows)[:, None], scored + 1].set(jnp.where(scored_inside, x, 0.0),
                                                   mode='drop')
  else:
    place = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  shift = lambda x: jnp.where(valid, place(x), 0.0)
  pairs = None
  if harvest_top_k:
    index, inside = (span_positions(starts, harvest_span, width) if harvest_span else
                     span_positions(jnp.zeros(rows, jnp.int32), width, width))
    take = lambda x: take_positions(x, index)
    if logits is not None and score_span and score_span == harvest_span:
      span_logits = logits
    else:
      # The last position is never scored; heads never read its target (the horizon is
      # past the row), so it takes the one before's. Streamed logits were not kept: the
      # span's positions are projected again.
      projected = jnp.minimum(index, width - 2)
      span_logits = (take_positions(logits, projected) if logits is not None and not score_span
                     else _project(config, params, take_positions(hidden, projected)))
    ids, target_logp = jax.lax.stop_gradient(top_targets(span_logits, harvest_top_k))
    pairs = DistillPairs(hidden=jax.lax.stop_gradient(take(features)), target_ids=ids,
                      target_logp=target_logp, tokens=take(safe), valid=take(valid) & inside)
  return shift(logp), shift(entropy), pairs


@partial(jax.jit, static_argnums=(0, 3, 4))
def token_logprobs(config: ModelConfig, params, tokens, temperature: float,
                   stream_logits: bool = False) -> jax.Array:
  """float32 [B, T]: index t holds log pi(tokens[:, t] | tokens[:, :t]) (0 at t=0, padding).

  tokens: int32 [B, T] right padded with -1; the same scaling as the rollout log-probs.
  stream_logits as in GRPOConfig (this pass has every row of the batch at once).
  """
  return _scored_forward(config, params, tokens, temperature,
                         stream_logits=stream_logits)[0]


def loss_weights(aggregation: str, response_mask) -> jax.Array:
  """Per-token weights [B, T] of the whole batch; they sum to 1 when any token is scored.

  sequence-mean averages over sequences that have at least one scored token, so all-padding
  rows (added to fill a micro-batch) change nothing.
  """
  mask = response_mask.astype(jnp.float32)
  if aggregation == 'token-mean':
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  lengths = jnp.sum(mask, axis=1, keepdims=True)
  sequences = jnp.sum(lengths > 0)
  return mask / jnp.maximum(lengths, 1.0) / jnp.maximum(sequences, 1)


def surrogate_loss(config: GRPOConfig, logprobs, batch: RolloutBatch, weights):
  """The GRPO loss from the current policy's log-probs [B, T]; returns (loss, metrics).

  Per token: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) with
  ratio = exp(logp - old_logp), plus kl_coef * k3, k3 = exp(ref - logp) - (ref - logp) - 1
  (an unbiased, non-negative estimate of KL(pi || ref) on tokens sampled from pi).
  Metrics are weighted like the loss, so they too add up over micro-batches: clip_fraction
  is the weight of tokens whose gradient the clip removes.
  """
  if config.kl_coef > 0 and batch.ref_logprobs is None:
    raise ValueError('kl_coef > 0 needs batch.ref_logprobs')
  mask = batch.response_mask
  # Off-mask log-probs are arbitrary; zeroing the differences keeps exp() and its gradient
  # finite there.
  log_ratio = jnp.where(mask, logprobs - batch.old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  advantage = batch.advantages[:, None]
  low, high = 1.0 - config.clip_epsilon_low, 1.0 + config.clip_epsilon_high
  objective = jnp.minimum(ratio * advantage, jnp.clip(ratio, low, high) * advantage)
  clipped = ((ratio < low) & (advantage < 0)) | ((ratio > high) & (advantage > 0))
  weighted = lambda x: jnp.sum(weights * x)
  policy_loss = -weighted(objective)
  metrics = {'policy_loss': policy_loss, 'clip_fraction': weighted(clipped),
             'ratio': weighted(ratio)}
  loss = policy_loss
  if batch.ref_logprobs is not None:
    delta = jnp.where(mask, batch.ref_logprobs - logprobs, 0.0)
    metrics['kl'] = weighted(jnp.exp(delta) - delta - 1.0)
    if config.kl_coef > 0:
      loss = loss + config.kl_coef * metrics['kl']
  metrics['loss'] = loss
  return loss, metrics


def grpo_loss(model_config: ModelConfig, config: GRPOConfig, params, batch: RolloutBatch,
              weights=None):
  """Forward + `surrogate_loss`; returns (loss, metrics incl. the mean entropy).

  weights: `loss_weights` of the whole batch when `batch` is one micro-batch of it;
  None computes them from `batch` itself.
  """
  loss, (metrics, _) = _loss_and_pairs(model_config, config, params, batch, weights)
  return loss, metrics


def policy_params(config: GRPOConfig, trained, base=None):
  """The policy's parameters from what the optimizer trains: the parameters themselves,
  or (LoRA) the adapters merged into the frozen `base`."""
  return trained if base is None else lora.merge(base, trained, config.lora_scale)


def _loss_and_pairs(model_config: ModelConfig, config: GRPOConfig, params, batch: RolloutBatch,
                    weights=None, base=None):
  if weights is None:
    weights = loss_weights(config.loss_aggregation, batch.response_mask)
  # The last prompt position: the first pair whose horizon lies in the response.
  starts = jnp.maximum(jnp.argmax(batch.response_mask, axis=1) - 1, 0)
  logprobs, entropy, pairs = _scored_forward(model_config, policy_params(config, params, base),
                                             batch.tokens, config.temperature,
                                             config.harvest_top_k, config.harvest_span, starts,
                                             config.stream_logits, config.score_span,
                                             config.harvest_feature_layers)
  if config.learner_old_logprobs:
    batch = batch.replace(old_logprobs=jnp.where(batch.response_mask,
                                                 jax.lax.stop_gradient(logprobs), 0.0))
  loss, metrics = surrogate_loss(config, logprobs, batch, weights)
  metrics['entropy'] = jnp.sum(weights * jax.lax.stop_gradient(entropy))
  return loss, (metrics, pairs)


def accumulated_gradients(model_config: ModelConfig, config: GRPOConfig, params,
                          batch: RolloutBatch, base=None, mesh=None):
  """Full-batch (gradient, metrics) from fixed-size micro-batches under lax.scan.

  Only one micro-batch's activations are live at a time, and every micro-batch has the
  same shapes, so one compilation serves any number of them. Gradients are summed in
  float32 and returned in the parameters' dtype. Returns (grads, metrics, pairs): pairs is
  the slow path's DistillPairs over all rows when config.harvest_top_k > 0, else None.
  `params` are what is trained: the policy, or LoRA adapters on the frozen `base`. With a
  mesh, each micro-batch's rows are split over the mesh's row axes (without the constraint
  a micro-batch would sit on the devices that held its rows of the whole batch).
  """
  rows = batch.tokens.shape[0]
  size = config.micro_batch_size
  if rows % size:
    raise ValueError(f'batch has {rows} rows, not a multiple of micro_batch_size={size} '
                     '(pad with all -1 rows: they carry no weight)')
  weights = loss_weights(config.loss_aggregation, batch.response_mask)
  chunks = jax.tree.map(lambda x: x.reshape(rows // size, size, *x.shape[1:]),
                        (batch, weights))
  if mesh is not None:
    chunks = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, P(None, ROWS))), chunks)
  grad_fn = jax.grad(partial(_loss_and_pairs, model_config, config, base=base), has_aux=True)

  def micro_step(total, chunk):
    grads, aux = grad_fn(params, *chunk)
    return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, grads), aux

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  if mesh is not None:
    zeros = jax.lax.with_sharding_constraint(zeros, param_sharding(mesh, params))
  grads, (metrics, pairs) = jax.lax.scan(micro_step, zeros, chunks)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  pairs = jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), pairs)
  return grads, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics), pairs


def make_optimizer(config: GRPOConfig) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                     optax.adamw(config.learning_rate, weight_decay=config.weight_decay))


def train_step(model_config: ModelConfig, config: GRPOConfig, params, opt_state,
               batch: RolloutBatch, base=None, mesh=None):
  """One AdamW update of the trained params (the policy, or LoRA adapters on the frozen
  `base`) on the whole batch.

  With a mesh, the updated params and optimizer state keep the partition rules'
  shardings (model/mesh.py).
  opt_state comes from `make_optimizer(config).init(params)`. Returns (params, opt_state,
  metrics, pairs); metrics['grad_norm'] is the global norm before clipping; pairs are the
  head-training pairs of `accumulated_gradients` (None unless config.harvest_top_k > 0).
  A non-finite loss or gradient norm (one inf log-prob is enough) would write NaN into
  every parameter through Adam's moments, so that update is rolled back: the params and
  optimizer state come back unchanged and metrics['update_skipped'] is 1.
  """
  grads, metrics, pairs = accumulated_gradients(model_config, config, params, batch, base, mesh)
  metrics['grad_norm'] = optax.tree.norm(grads)
  optimizer = make_optimizer(config)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  metrics['update_skipped'] = (~finite).astype(jnp.float32)
  new_params, new_opt_state = (keep(optax.apply_updates(params, updates), params),
                               keep(new_opt_state, opt_state))
  if mesh is not None:
    shardings = param_sharding(mesh, params)
    new_params = jax.lax.with_sharding_constraint(new_params, shardings)
    new_opt_state = jax.lax.with_sharding_constraint(
        new_opt_state, optimizer_sharding(mesh, optimizer, new_opt_state, shardings))
  return new_params, new_opt_state, metrics, pairs


_STATIC = dict(static_argnums=(0, 1), static_argnames=('mesh',))
# Donating the trained params and their optimizer state lets the update write the new ones
# into the old buffers: one copy of each at the step's peak instead of two (SmolLM2's
# float32 params and AdamW moments are 1.5 GiB). For callers that never read the inputs
# again; the inputs are deleted.
train_step_in_place = jax.jit(train_step, donate_argnums=(2, 3), **_STATIC)
train_step = jax.jit(train_step, **_STATIC)
