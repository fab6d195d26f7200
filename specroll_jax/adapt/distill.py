"""Self-distillation of the horizon heads on the policy's own generations.

Training pairs come from one full-sequence policy forward over (prompt + response): the
hidden state h_t, and at the horizon position t+k the policy's top-K distribution
p_{t+k} (the law of token x_{t+k+1}) and the realised token x_{t+k+1}. Head k's loss is
KL(p_{t+k} || q_{t,k}) over the policy's top-K tokens plus the cross-entropy of the
realised token, weighted 0.8^k across heads. Only head parameters receive gradients.

Heads with a draft vocabulary (HeadsConfig.draft_vocab) normalise q over it and score only
the targets inside it: a token they can never draft teaches them nothing. The warm start
chooses that vocabulary from its training text (DistillConfig.draft_vocab_size).
"""
import dataclasses
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.transformer import final_hidden, padded_sequence_hidden
from specroll_jax.model.vocab_chunks import map_projected
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.draft_vocabulary import frequency_vocabulary, vocabulary_index
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.heads import (HeadsConfig, HeadsMetadata, apply_heads, has_heads,
                                     init_heads, load_heads, save_heads)
from specroll_jax.speculative.pairs import DistillPairs, response_spans, shifted, top_targets
from specroll_jax.speculative.proposer import Vocabulary


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  target_top_k: int = 32
  head_decay: float = 0.8
  ce_weight: float = 1.0
  learning_rate: float = 3e-3
  weight_decay: float = 0.0
  batch_size: int = 32
  steps: int = 600
  # The warm start's draft vocabulary: the tokens most frequent as next tokens in its
  # training generations (0, or the policy's vocabulary size or more: the whole vocabulary).
  # The slow path keeps the heads' own.
  draft_vocab_size: int = 0


@partial(jax.jit, static_argnums=(0, 3, 4))
def policy_targets(model_config: ModelConfig, params, tokens, top_k: int,
                   feature_layers: tuple = ()):
  """One forward over padded sequences -> hidden states (widened with the outputs of decoder
  `feature_layers`: padded_sequence_hidden) and top-K next-token log-probs."""
  features, _, _ = padded_sequence_hidden(model_config, params, tokens, feature_layers)
  hidden = final_hidden(model_config, features)
  batch, width, dim = hidden.shape
  ids, logp = map_projected(model_config, params, hidden.reshape(-1, dim),
                            lambda logits: top_targets(logits, top_k))
  return features, ids.reshape(batch, width, top_k), logp.reshape(batch, width, top_k)


def build_batch(model_config: ModelConfig, params, sequences: list[list[int]], width: int,
                top_k: int, feature_layers: tuple = ()) -> DistillPairs:
  """Pads token sequences to `width` (-1 = padding) and runs the policy over them (its
  hidden states widened with the outputs of decoder `feature_layers`)."""
  tokens = np.full((len(sequences), width), -1, np.int32)
  for i, seq in enumerate(sequences):
    seq = seq[:width]
    tokens[i, :len(seq)] = seq
  tokens = jnp.asarray(tokens)
  hidden, ids, logp = policy_targets(model_config, params, tokens, top_k, tuple(feature_layers))
  return DistillPairs(hidden=hidden, target_ids=ids, target_logp=logp,
                      tokens=jnp.maximum(tokens, 0), valid=tokens >= 0)


def _horizon_mask(batch: DistillPairs, num_heads: int):
  """[B, T, H]: position t and its head-k horizon t+k+1 are both real tokens."""
  return jnp.stack([shifted(batch.valid, k + 1) & batch.valid
                    for k in range(1, num_heads + 1)], axis=2)


def _head_log_probs(heads_config: HeadsConfig, model_config: ModelConfig, head_params,
                    policy_params, batch: DistillPairs):
  """log q_{t,k} at head k's targets: (at the policy's top-K [B, T, H, K], at the realised
  token [B, T, H], mask [B, T, H] of positions whose horizon t+k+1 is a real token, which
  targets [B, T, H, K + 1] the heads can draft: all of them without a draft vocabulary)."""
  z = apply_heads(heads_config, model_config, head_params, batch.hidden)  # [B, T, H, D]
  num_heads, dim = z.shape[2:]
  # Head k at position t predicts x_{t+k+1}, whose law is the policy's output at t+k.
  horizons = range(1, num_heads + 1)
  ids = jnp.stack([jnp.concatenate([shifted(batch.target_ids, k),
                                    shifted(batch.tokens, k + 1)[..., None]], axis=-1)
                   for k in horizons], axis=2)  # [B, T, H, K + 1]
  mask = _horizon_mask(batch, num_heads)
  vocab_ids = heads_config.vocab_ids()
  if vocab_ids is None:
    log_q = map_projected(
        model_config, policy_params, z.reshape(-1, dim),
        lambda logits, row_ids: (jnp.take_along_axis(logits, row_ids, axis=-1)
                                 - jax.nn.logsumexp(logits, axis=-1, keepdims=True)),
        ids.reshape(-1, ids.shape[-1])).reshape(ids.shape)
    inside = jnp.ones(ids.shape, bool)
  else:
    logits = Vocabulary(policy_params, model_config).draft_logits(z, vocab_ids)
    index, inside = vocabulary_index(vocab_ids, ids)
    log_q = jnp.where(inside, jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), index,
                                                  axis=-1), 0.0)
  return log_q[..., :-1], log_q[..., -1], mask, inside


def head_losses(heads_config: HeadsConfig, model_config: ModelConfig, head_params,
                policy_params, batch: DistillPairs):
  """Per-head (KL, CE, count) over positions t whose horizon t+k+1 is a real token."""
  q_at_targets, q_realised, mask, inside = _head_log_probs(heads_config, model_config,
                                                           head_params, policy_params, batch)
  num_heads = mask.shape[2]
  target_logp = jnp.stack([shifted(batch.target_logp, k) for k in range(1, num_heads + 1)],
                          axis=2)  # [B, T, H, K]
  kl = jnp.sum(jnp.where(inside[..., :-1],
                         jnp.exp(target_logp) * (target_logp - q_at_targets), 0.0), axis=-1)
  masked_sum = lambda x: jnp.sum(jnp.where(mask, x, 0.0), axis=(0, 1))
  return (masked_sum(kl), masked_sum(jnp.where(inside[..., -1], -q_realised, 0.0)),
          jnp.sum(mask, axis=(0, 1)))


def distill_loss(heads_config, model_config, config: DistillConfig, head_params, policy_params,
                 batch: DistillPairs):
  kl, ce, count = head_losses(heads_config, model_config, head_params, policy_params, batch)
  weights = config.head_decay ** jnp.arange(1, heads_config.num_heads + 1)
  per_head = (kl + config.ce_weight * ce) / jnp.maximum(count, 1)
  return jnp.sum(weights * per_head) / jnp.sum(weights)


def make_optimizer(config: DistillConfig) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(config.learning_rate, weight_decay=config.weight_decay))


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def train_step(heads_config, model_config, config: DistillConfig, optimizer, head_params,
               opt_state, policy_params, batch: DistillPairs):
  loss, grads = jax.value_and_grad(
      lambda hp: distill_loss(heads_config, model_config, config, hp, policy_params, batch))(
          head_params)
  updates, opt_state = optimizer.update(grads, opt_state, head_params)
  return optax.apply_updates(head_params, updates), opt_state, loss


@partial(jax.jit, static_argnums=(0, 1, 4))
def rank_hits(heads_config: HeadsConfig, model_config: ModelConfig, head_params, policy_params,
              ranks: int, batch: DistillPairs):
  """Per head and rank r < `ranks`: how often the realised x_{t+k+1} is head k's rank-r token.

  Returns (hits [H, ranks], count [H]); hits[:, 0] / count is top-1 agreement, and the rates
  seed the tree's online (head, rank) acceptance statistics.
  """
  z = apply_heads(heads_config, model_config, head_params, batch.hidden)
  batch_size, width, num_heads, dim = z.shape
  vocab_ids = heads_config.vocab_ids()
  if vocab_ids is None:
    guesses = map_projected(model_config, policy_params, z.reshape(-1, dim),
                            lambda logits: jax.lax.top_k(logits, ranks)[1])
    guesses = guesses.reshape(batch_size, width, num_heads, ranks)
  else:
    logits = Vocabulary(policy_params, model_config).draft_logits(z, vocab_ids)
    guesses = vocab_ids[jax.lax.top_k(logits, ranks)[1]]
  horizons = range(1, num_heads + 1)
  realised = jnp.stack([shifted(batch.tokens, k + 1) for k in horizons], axis=2)
  mask = _horizon_mask(batch, num_heads)
  match = (guesses == realised[..., None]) & mask[..., None]
  return jnp.sum(match, axis=(0, 1)), jnp.sum(mask, axis=(0, 1))


def stack_batches(model_config: ModelConfig, params, sequences, width: int, top_k: int,
                  chunk: int = 16, feature_layers: tuple = ()) -> DistillPairs:
  """build_batch over chunks of sequences (bounded memory), concatenated on the host.

  16 sequences per forward: on SmolLM2 (330-token rows) the forward peaked at 1.66 GB
  resident with 16 and 2.42 GB with 64 (1.23 GB is the loaded policy)."""
  chunks = [build_batch(model_config, params, sequences[i:i + chunk], width, top_k,
                        feature_layers)
            for i in range(0, len(sequences), chunk)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)


def optax_loop(step, params, opt_state, train: DistillPairs, steps: int, batch_size: int,
               seed: int, desc: str):
  """`steps` calls of step(params, opt_state, batch) -> (params, opt_state, loss) on random
  batches of `batch_size` rows of `train`, with a progress bar; (params, opt_state, loss)."""
  rng = np.random.default_rng(seed)
  rows = train.tokens.shape[0]
  loss = float('nan')
  with tqdm(range(steps), desc=desc, file=sys.stderr) as bar:
    for _ in bar:
      index = rng.choice(rows, min(batch_size, rows), replace=False)
      params, opt_state, loss = step(params, opt_state, jax.tree.map(lambda x: x[index], train))
      bar.set_postfix(loss=f'{float(loss):.3f}')
  return params, opt_state, float(loss)


def train_heads(policy, heads_config: HeadsConfig, config: DistillConfig, train: DistillPairs,
                seed: int = 0, init_params=None):
  """Optax training of the head pytree alone; returns (head params, last loss)."""
  params = init_params if init_params is not None else init_heads(heads_config, policy.config,
                                                                  seed)
  optimizer = make_optimizer(config)
  step = lambda params, opt_state, batch: train_step(heads_config, policy.config, config,
                                                     optimizer, params, opt_state,
                                                     policy.params, batch)
  params, _, loss = optax_loop(step, params, optimizer.init(params), train, config.steps,
                               config.batch_size, seed, 'training heads')
  return params, loss


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """Which of the policy's own generations the heads are self-distilled on."""
  num_sequences: int = 512   # training generations
  held_out: int = 64         # held-out generations for the hit-rate report
  max_new_tokens: int = 256  # tokens per generation
  temperature: float = 1.0   # sampling temperature of the generations
  seed: int = 0              # generation, initialisation and batching


@dataclasses.dataclass(frozen=True)
class WarmStartResult:
  heads_config: HeadsConfig  # with the draft vocabulary the warm start chose
  params: dict
  loss: float
  rank_hit_rate_before: np.ndarray  # [H, ranks] on held-out generations
  rank_hit_rate_after: np.ndarray


def generated_pairs(policy, prompts, plan: WarmStart, top_k: int,
                    feature_layers: tuple = ()) -> tuple[DistillPairs, DistillPairs]:
  """(training, held-out) pairs over the policy's own generations from `prompts`: the
  response spans, with the policy's top-`top_k` targets at every position (and the outputs
  of decoder `feature_layers` beside the hidden states)."""
  total = plan.num_sequences + plan.held_out
  prompt_rows = [prompts[i % len(prompts)] for i in range(total)]
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=plan.temperature))
  driver = Driver(engine, RolloutConfig(plan.max_new_tokens, max_batch=64))
  with tqdm(total=total, desc='generating', file=sys.stderr) as bar:
    responses = driver.generate(policy.params, prompt_rows, 1, plan.seed, progress=bar)
  sequences = [prompt_rows[r.prompt_index] + r.token_ids for r in responses]
  width = max(len(p) for p in prompt_rows) + plan.max_new_tokens
  # Proposals start at the last prompt position, so pairs are the response spans (a chat
  # model's prompt is over half of each row: half the training cost).
  starts = jnp.asarray([len(p) - 1 for p in prompt_rows], jnp.int32)
  spans = lambda batch, rows: response_spans(batch, starts[rows], plan.max_new_tokens + 1)
  train = spans(stack_batches(policy.config, policy.params, sequences[:plan.num_sequences],
                              width, top_k, feature_layers=feature_layers),
                slice(0, plan.num_sequences))
  held = spans(stack_batches(policy.config, policy.params, sequences[plan.num_sequences:],
                             width, top_k, feature_layers=feature_layers),
               slice(plan.num_sequences, total))
  return train, held


def warm_start(policy, heads_config: HeadsConfig, config: DistillConfig, prompts,
               plan: WarmStart, report_ranks: int = 8) -> WarmStartResult:
  """Samples the policy's own generations and self-distils fresh heads on them (over a
  draft vocabulary of config.draft_vocab_size, chosen from the training generations)."""
  train, held = generated_pairs(policy, prompts, plan, config.target_top_k)
  vocab_size = policy.config.vocab_size
  if 0 < config.draft_vocab_size < vocab_size:
    heads_config = dataclasses.replace(heads_config, draft_vocab=tuple(frequency_vocabulary(
        train.tokens, train.valid, config.draft_vocab_size, vocab_size)))

  def rates(params):
    hits, counts = rank_hits(heads_config, policy.config, params, policy.params, report_ranks,
                             held)
    return np.asarray(hits) / np.maximum(np.asarray(counts), 1)[:, None]

  before = rates(init_heads(heads_config, policy.config, plan.seed))
  params, loss = train_heads(policy, heads_config, config, train, plan.seed)
  return WarmStartResult(heads_config, params, loss, before, rates(params))


def warm_start_and_save(policy, heads_config: HeadsConfig, config: DistillConfig, prompts,
                        plan: WarmStart, directory, source: str) -> WarmStartResult:
  """`warm_start`, then the heads and how they were made (HeadsMetadata) into `directory`;
  `source` names the policy they were trained on."""
  start = time.perf_counter()
  result = warm_start(policy, heads_config, config, prompts, plan)
  save_heads(directory, result.heads_config, result.params, HeadsMetadata(
      source=source, num_sequences=plan.num_sequences, max_new_tokens=plan.max_new_tokens,
      temperature=plan.temperature, steps=config.steps, final_loss=result.loss,
      rank_hit_rate=result.rank_hit_rate_after.tolist(), seconds=time.perf_counter() - start))
  return result


def ensure_heads(policy, heads_config: HeadsConfig, config: DistillConfig, prompts,
                 plan: WarmStart, directory, source: str) -> tuple[HeadsConfig, dict]:
  """The heads saved in `directory`, warm-started there first when it holds none."""
  if not has_heads(directory):
    print(f'warm-starting heads into {directory}', file=sys.stderr)
    warm_start_and_save(policy, heads_config, config, prompts, plan, directory, source)
  return load_heads(directory, policy.config)
