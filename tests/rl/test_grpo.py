"""GRPO core: advantages and the clipped surrogate by hand, learner/rollout log-prob
alignment, exact micro-batch accumulation, and the direction of an update."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.model import vocab_chunks
from specroll_jax.model.config import ModelConfig, RopeConfig
from specroll_jax.model.transformer import Transformer, causal_mask, padded_sequence_features
from specroll_jax.rl import grpo
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.response import Response
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.pairs import span_positions, take_positions

TINY = ModelConfig(architecture='LlamaForCausalLM', vocab_size=64, hidden_size=32,
                   intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=64, rms_norm_eps=1e-5, rope=RopeConfig(),
                   tie_word_embeddings=False, qkv_bias=False, o_bias=False, bos_token_id=1,
                   eos_token_id=2)


@pytest.fixture(scope='module')
def tiny_params():
  tokens = jnp.zeros((1, 4), jnp.int32)
  positions = jnp.arange(4)[None]
  mask = causal_mask(jnp.ones((1, 4), bool))
  # Through `project` as well, so that the untied lm_head is created.
  forward = lambda model, *args: model.project(model(*args)[0])
  init = lambda key: Transformer(TINY).init(key, tokens, positions, mask, method=forward)
  # Shapes only (compiling init costs seconds). Norms near 1, matrices N(0, 0.3^2), wider
  # than Flax's init, so next-token entropy is ~3 nats against ln 64 = 4.2 for uniform.
  shapes = jax.eval_shape(init, jax.random.key(0))['params']
  rng = np.random.default_rng(0)
  fill = lambda s: (1 + 0.1 * rng.normal(size=s.shape) if len(s.shape) == 1
                    else rng.normal(size=s.shape) * 0.3)
  return jax.tree.map(lambda s: jnp.asarray(fill(s), jnp.float32), shapes)


def test_group_advantages_use_the_population_std():
  # Group 1: mean 1/4, population std sqrt(3)/4 -> A = sqrt(3), -1/sqrt(3) x3.
  # Group 2: equal rewards -> A = 0 (eps avoids 0/0).
  rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
  a = np.asarray(grpo.group_advantages(rewards, 4, eps=1e-6))
  std = math.sqrt(3) / 4
  expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3 + [0.0] * 4
  np.testing.assert_allclose(a, expected, rtol=1e-6)
  np.testing.assert_allclose(a[:4], [math.sqrt(3)] + [-1 / math.sqrt(3)] * 3, rtol=1e-5)
  with pytest.raises(ValueError, match='G=3'):
    grpo.group_advantages(rewards, 3)


# Hand example: 4 sequences (2 groups of 2), width 4, prompt = position 0, eps 0.2/0.2.
#   row  A     scored ratios     objective min(r*A, clip(r)*A)          clipped
#   0    1     1, 1.5, 0.5       1, 1.2, 0.5         (sum 2.7, mean 0.9)  1.5 (high)
#   1   -1     0.5               -0.8                (mean -0.8)          0.5 (low)
#   2    2     1.1, 0.7          2.2, 1.4            (sum 3.6, mean 1.8)  -
#   3   -0.5   1.5, 0.9, 1.0     -0.75, -0.45, -0.5  (sum -1.7)           - (min keeps 1.5)
# token-mean:    loss = -(2.7 - 0.8 + 3.6 - 1.7) / 9 = -3.8 / 9, clip fraction 2/9,
#                mean ratio 8.7 / 9.
# sequence-mean: loss = -(0.9 - 0.8 + 1.8 - 1.7/3) / 4 = -1/3, clip fraction (1/3 + 1)/4 = 1/3,
#                mean ratio (1 + 0.5 + 0.9 + 3.4/3) / 4 = 0.8833...
MASK = np.array([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], bool)
RATIOS = np.array([[1, 1, 1.5, 0.5], [1, 0.5, 1, 1], [1, 1.1, 0.7, 1], [1, 1.5, 0.9, 1.0]])
ADVANTAGES = np.array([1.0, -1.0, 2.0, -0.5], np.float32)


def _hand_batch():
  old = np.where(MASK, -1.0, 0.0).astype(np.float32)
  # Off-mask log-probs are junk (ratio e^3 if they leaked into the loss).
  logp = np.where(MASK, old + np.log(RATIOS), 3.0).astype(np.float32)
  batch = grpo.RolloutBatch(tokens=jnp.zeros((4, 4), jnp.int32),
                            response_mask=jnp.asarray(MASK), old_logprobs=jnp.asarray(old),
                            advantages=jnp.asarray(ADVANTAGES))
  return batch, jnp.asarray(logp)


@pytest.mark.parametrize('aggregation, loss, clip_fraction, ratio', [
    ('token-mean', -3.8 / 9, 2 / 9, 8.7 / 9),
    ('sequence-mean', -1 / 3, 1 / 3, (1 + 0.5 + 0.9 + 3.4 / 3) / 4)])
def test_surrogate_by_hand(aggregation, loss, clip_fraction, ratio):
  config = grpo.GRPOConfig(loss_aggregation=aggregation)
  batch, logp = _hand_batch()
  weights = grpo.loss_weights(aggregation, batch.response_mask)
  value, metrics = grpo.surrogate_loss(config, logp, batch, weights)
  np.testing.assert_allclose(value, loss, rtol=1e-6)
  np.testing.assert_allclose(metrics['clip_fraction'], clip_fraction, rtol=1e-6)
  np.testing.assert_allclose(metrics['ratio'], ratio, rtol=1e-6)
  assert 'kl' not in metrics


def test_surrogate_gradient_by_hand():
  # d loss / d logp = -w * A * ratio where the unclipped branch is taken, 0 where clipped
  # and off the mask; token-mean w = 1/9.
  config = grpo.GRPOConfig()
  batch, logp = _hand_batch()
  weights = grpo.loss_weights('token-mean', batch.response_mask)
  grad = jax.grad(lambda lp: grpo.surrogate_loss(config, lp, batch, weights)[0])(logp)
  expected = -np.array([[0, 1, 0, 0.5], [0, 0, 0, 0], [0, 2.2, 1.4, 0],
                        [0, -0.75, -0.45, -0.5]]) / 9
  np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


def test_sequence_mean_and_token_mean_weights_on_unequal_lengths():
  # Lengths 1 and 3: token-mean gives each of the 4 tokens 1/4; sequence-mean gives the
  # lone token 1/2 and each of the other three 1/6. An all-padding row gets no weight.
  mask = jnp.asarray([[0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_allclose(grpo.loss_weights('token-mean', mask),
                             [[0, 1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4, 0], [0, 0, 0, 0]])
  np.testing.assert_allclose(grpo.loss_weights('sequence-mean', mask),
                             [[0, 1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0], [0, 0, 0, 0]])


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
  batch, logp = _hand_batch()
  weights = grpo.loss_weights('token-mean', batch.response_mask)
  plain, _ = grpo.surrogate_loss(grpo.GRPOConfig(), logp, batch, weights)
  config = grpo.GRPOConfig(kl_coef=0.5)
  at_ref = batch.replace(ref_logprobs=logp)
  loss, metrics = grpo.surrogate_loss(config, logp, at_ref, weights)
  assert float(metrics['kl']) == 0.0
  np.testing.assert_allclose(loss, plain, rtol=1e-7)
  # ref - logp = +-ln 2 on every scored token: k3 = 1 - ln 2 and 1/2 - 1 + ln 2.
  for shift, k3 in ((math.log(2), 1 - math.log(2)), (-math.log(2), math.log(2) - 0.5)):
    loss, metrics = grpo.surrogate_loss(config, logp, batch.replace(ref_logprobs=logp + shift),
                                        weights)
    np.testing.assert_allclose(metrics['kl'], k3, rtol=1e-5)
    np.testing.assert_allclose(loss, plain + 0.5 * k3, rtol=1e-5)
  with pytest.raises(ValueError, match='ref_logprobs'):
    grpo.surrogate_loss(config, logp, batch, weights)


def test_config_errors():
  with pytest.raises(ValueError, match='loss_aggregation'):
    grpo.GRPOConfig(loss_aggregation='mean')
  with pytest.raises(ValueError, match='clip_epsilon_low'):
    grpo.GRPOConfig(clip_epsilon_low=1.0)
  with pytest.raises(ValueError, match='advantage_eps'):
    grpo.GRPOConfig(advantage_eps=0.0)


def _padded(rows, width):
  tokens = np.full((len(rows), width), -1, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens


def test_token_logprobs_equal_the_policy_logits(stories_policy):
  row = [1] + list(np.random.default_rng(0).integers(3, 512, 11))
  logits = np.asarray(stories_policy.logits(np.array([row])))[0]
  logp = np.asarray(jax.nn.log_softmax(logits / 0.7, axis=-1))
  # Index t scores token t under the logits at t - 1.
  expected = logp[np.arange(len(row) - 1), row[1:]]
  # Causal: prefixes of the row, right padded, score the same tokens the same way.
  lengths = (12, 5, 8)
  got = np.asarray(grpo.token_logprobs(stories_policy.config, stories_policy.params,
                                       jnp.asarray(_padded([row[:n] for n in lengths], 12)),
                                       0.7))
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(got[i, 1:n], expected[:n - 1], atol=1e-5, rtol=1e-5)
    assert got[i, 0] == 0 and not got[i, n:].any()


def _pack(prompts, responses, advantages, width):
  return grpo.batch_from_rollouts([prompts[r.prompt_index] for r in responses],
                                  [r.token_ids for r in responses],
                                  [r.logprobs for r in responses], advantages, width)


def test_packed_rollout_logprobs_are_what_the_learner_recomputes(stories_policy):
  policy = stories_policy
  prompts = [policy.tokenizer.encode(t) for t in ('Once upon a time', 'The dog')]
  engine = VanillaEngine(policy.config, SamplerConfig(temperature=0.8), (2,))
  responses = Driver(engine, RolloutConfig(max_new_tokens=12, max_batch=4)).generate(
      policy.params, prompts, 2, seed=0)
  width = max(map(len, prompts)) + 12
  batch = _pack(prompts, responses, [1.0, -1.0, 0.5, -0.5], width)
  for i, r in enumerate(responses):
    start = len(prompts[r.prompt_index])
    row = np.asarray(batch.tokens[i])
    assert row[:start].tolist() == prompts[r.prompt_index]
    assert row[start:start + len(r.token_ids)].tolist() == r.token_ids
    assert (row[start + len(r.token_ids):] == -1).all()
    assert np.flatnonzero(batch.response_mask[i]).tolist() == list(
        range(start, start + len(r.token_ids)))
  recomputed = grpo.token_logprobs(policy.config, policy.params, batch.tokens, 0.8)
  # The cached decode and the full-sequence forward agree to the float32 floor measured in
  # WORKSPACE_NOTES (a few 1e-5), so on-policy ratios are 1 to that precision.
  np.testing.assert_allclose(np.where(batch.response_mask, recomputed, 0), batch.old_logprobs,
                             atol=1e-4)
  with pytest.raises(ValueError, match='width is'):
    _pack(prompts, responses, [0.0] * 4, width - 1)
  bad = [Response(0, 0, [5, 6], [-1.0], 'eos', 2)]
  with pytest.raises(ValueError, match='1 log-probs'):
    _pack(prompts, bad, [0.0], width)


def _random_batch(params, width=10):
  """8 ragged rows (the last all padding), off-policy old log-probs and a reference."""
  rng = np.random.default_rng(1)
  lengths = [3, 10, 6, 4, 9, 2, 7, 0]
  prompt = [2, 3, 1, 2, 4, 1, 3, 0]
  rows = len(lengths)
  tokens = _padded([list(rng.integers(3, TINY.vocab_size, n)) for n in lengths], width)
  mask = np.zeros((rows, width), bool)
  for i in range(rows):
    mask[i, prompt[i]:lengths[i]] = True
  logp = grpo.token_logprobs(TINY, params, jnp.asarray(tokens), 1.0)
  noise = lambda scale: jnp.asarray(rng.normal(0, scale, (rows, width)), jnp.float32)
  return grpo.RolloutBatch(
      tokens=jnp.asarray(tokens), response_mask=jnp.asarray(mask),
      old_logprobs=jnp.where(mask, logp + noise(0.3), 0.0),
      advantages=jnp.asarray(rng.normal(0, 1, rows), jnp.float32),
      ref_logprobs=jnp.where(mask, logp + noise(0.1), 0.0))


@pytest.mark.parametrize('aggregation', grpo.AGGREGATIONS)
def test_micro_batches_give_the_full_batch_gradient(aggregation, tiny_params):
  params = tiny_params
  batch = _random_batch(params)
  config = grpo.GRPOConfig(loss_aggregation=aggregation, kl_coef=0.1, micro_batch_size=2,
                           learning_rate=1e-3, learner_old_logprobs=False)
  full_grads, full_metrics = jax.jit(jax.grad(grpo.grpo_loss, argnums=2, has_aux=True),
                                     static_argnums=(0, 1))(TINY, config, params, batch)
  assert 0 < float(full_metrics['clip_fraction']) < 1
  grads, metrics, _ = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1))(
      TINY, config, params, batch)
  # Same terms, summed in a different order and through differently shaped GEMMs: float32
  # rounding (~6e-8 per operation, over at most ~100 scored tokens) stays far below 1e-5 of
  # the largest entry of each gradient tensor.
  for g, f in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads)):
    np.testing.assert_allclose(g, f, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(f))))
  # Metrics are weighted means of O(1) per-token terms of both signs, so the loss can
  # nearly cancel: absolute float32 rounding, not relative.
  for name in full_metrics:
    np.testing.assert_allclose(metrics[name], full_metrics[name], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='micro_batch_size=3'):
    grpo.accumulated_gradients(TINY, grpo.GRPOConfig(micro_batch_size=3), params, batch)


def test_streamed_logits_give_the_same_loss_gradient_and_harvest(tiny_params, monkeypatch):
  # 5 positions per streamed chunk: 5 does not divide a micro-batch's 36 projected
  # positions (or the whole batch's 72), so the padded tail chunk is exercised too.
  monkeypatch.setattr(vocab_chunks, 'MAX_CHUNK_LOGITS', 5 * TINY.vocab_size)
  batch = _random_batch(tiny_params)
  whole = grpo.GRPOConfig(micro_batch_size=4, kl_coef=0.1, harvest_top_k=5, harvest_span=4)
  grad = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1))
  expected = grad(TINY, whole, tiny_params, batch)
  got = grad(TINY, dataclasses.replace(whole, stream_logits=True), tiny_params, batch)
  # The same terms; the lm_head's gradient adds positions per chunk, then over chunks: the
  # same 1e-5 of the largest entry bound as the micro-batch test above.
  for g, f in zip(jax.tree.leaves(got[0]), jax.tree.leaves(expected[0])):
    np.testing.assert_allclose(g, f, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(f))))
  for name in expected[1]:
    np.testing.assert_allclose(got[1][name], expected[1][name], rtol=1e-5, atol=1e-6)
  # The harvest projects the span's positions alone either way.
  np.testing.assert_array_equal(got[2].target_ids, expected[2].target_ids)
  np.testing.assert_array_equal(got[2].target_logp, expected[2].target_logp)


@pytest.mark.parametrize('stream', [False, True])
def test_scoring_only_the_response_span_gives_the_same_loss_gradient_and_harvest(
    stream, tiny_params, monkeypatch):
  monkeypatch.setattr(vocab_chunks, 'MAX_CHUNK_LOGITS', 5 * TINY.vocab_size)
  batch = _random_batch(tiny_params)
  # The longest response has 8 tokens (row 4: prompt 1, length 9), scored from the prompt's
  # last position: a span of 9. Row 1's span runs past its 10 positions (clipped).
  whole = grpo.GRPOConfig(micro_batch_size=4, kl_coef=0.1, harvest_top_k=5, harvest_span=9,
                          stream_logits=stream)
  grad = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1))
  expected = grad(TINY, whole, tiny_params, batch)
  got = grad(TINY, dataclasses.replace(whole, score_span=9), tiny_params, batch)
  # The same terms from a projection of fewer rows: the micro-batch test's bound.
  for g, f in zip(jax.tree.leaves(got[0]), jax.tree.leaves(expected[0])):
    np.testing.assert_allclose(g, f, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(f))))
  for name in expected[1]:
    np.testing.assert_allclose(got[1][name], expected[1][name], rtol=1e-5, atol=1e-6)
  # The harvest reuses the span's logits (whole) or projects them again (streamed). A
  # row's last position has no target in the batch: its pair is never read (the heads'
  # horizons lie past the row), and only there may the two differ.
  starts = jnp.maximum(jnp.argmax(batch.response_mask, 1) - 1, 0)
  readable = np.asarray(got[2].valid) & (np.asarray(span_positions(starts, 9, 10)[0]) < 9)
  np.testing.assert_array_equal(np.asarray(got[2].target_ids)[readable],
                                np.asarray(expected[2].target_ids)[readable])
  # Top-K log-probs of logits projected in differently shaped GEMMs: a few ulps at most, the
  # streamed log-prob test's bound (measured: 0 ulps, streamed and whole).
  np.testing.assert_array_max_ulp(np.asarray(got[2].target_logp)[readable],
                                  np.asarray(expected[2].target_logp)[readable], maxulp=4)


def test_a_harvest_with_layer_features_widens_the_pairs_and_changes_nothing_else(tiny_params):
  """For a drafter that fuses layer features, the harvest's pairs hold the hidden states the
  plain harvest holds, then the layer's outputs at the same positions (a full forward's);
  the gradient, the metrics and the targets are bit for bit the plain harvest's."""
  batch = _random_batch(tiny_params)
  plain = grpo.GRPOConfig(micro_batch_size=4, kl_coef=0.1, harvest_top_k=5, harvest_span=9,
                          score_span=9)
  grad = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1))
  expected = grad(TINY, plain, tiny_params, batch)
  got = grad(TINY, dataclasses.replace(plain, harvest_feature_layers=[0]), tiny_params, batch)
  for g, f in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(expected[:2])):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(f))
  for name in ('target_ids', 'target_logp', 'tokens', 'valid'):
    np.testing.assert_array_equal(getattr(got[2], name), getattr(expected[2], name))
  dim = TINY.hidden_size
  assert got[2].hidden.shape[-1] == 2 * dim
  np.testing.assert_array_equal(got[2].hidden[..., :dim], expected[2].hidden)
  starts = jnp.maximum(jnp.argmax(batch.response_mask, 1) - 1, 0)
  index, _ = span_positions(starts, 9, batch.tokens.shape[1])
  layer = take_positions(padded_sequence_features(TINY, tiny_params, batch.tokens, (0,)),
                         index)[..., dim:]
  valid = np.asarray(got[2].valid)
  # The same layer in another program and batch shape (inside the differentiated update's
  # micro-batches of 4 rows, against a forward over all 8): the same sums in other orders.
  # Measured: 8.6e-6 at magnitudes up to 19.5 (4.4e-7 of it, ~5 float32 ulps there); the
  # engine's feature test's bound, 1e-5 of the largest magnitude.
  expected_layer = np.asarray(layer)[valid]
  np.testing.assert_allclose(np.asarray(got[2].hidden[..., dim:])[valid], expected_layer,
                             rtol=0, atol=1e-5 * np.abs(expected_layer).max())


def test_streamed_log_probs_are_the_whole_projection_s(tiny_params, monkeypatch):
  monkeypatch.setattr(vocab_chunks, 'MAX_CHUNK_LOGITS', 5 * TINY.vocab_size)
  tokens = _random_batch(tiny_params).tokens
  logp = lambda stream: grpo.token_logprobs(TINY, tiny_params, tokens, 1.0, stream)
  # 5-position GEMMs against one of 8 x 9 positions: the logits' dot products round
  # differently (measured: 1 ulp on 6 of 80 log-probs), a few ulps, not a loose bound.
  np.testing.assert_array_max_ulp(logp(True), logp(False), maxulp=4)


def test_train_step_raises_logprobs_of_positive_advantage_sequences(tiny_params):
  params = tiny_params
  config = grpo.GRPOConfig(learning_rate=1e-2, micro_batch_size=2, learner_old_logprobs=False)
  batch = _random_batch(params)
  logp = grpo.token_logprobs(TINY, params, batch.tokens, 1.0)
  batch = batch.replace(old_logprobs=jnp.where(batch.response_mask, logp, 0.0),
                        advantages=jnp.asarray([1.0, -1.0] * 4), ref_logprobs=None)
  opt_state = grpo.make_optimizer(config).init(params)
  new_params, _, metrics, _ = grpo.train_step(TINY, config, params, opt_state, batch)
  # Every ratio is exp(0) = 1 exactly; the metric is their weighted float32 sum.
  assert float(metrics['ratio']) == pytest.approx(1.0, abs=1e-6)
  assert float(metrics['grad_norm']) > 0
  new_logp = grpo.token_logprobs(TINY, new_params, batch.tokens, 1.0)
  change = np.asarray(jnp.sum(jnp.where(batch.response_mask, new_logp - logp, 0.0), axis=1))
  # Row 7 is all padding: no tokens, no change.
  assert (change[0:7:2] > 0).all() and (change[1:7:2] < 0).all() and change[7] == 0, change


def test_learner_old_logprobs_ignore_the_rollout_logprobs(tiny_params):
  """pi_old from the learner's forward: the same update as exact behaviour log-probs, and
  nothing the engine reported (here: noise) reaches the gradient."""
  params = tiny_params
  batch = _random_batch(params)
  exact = batch.replace(old_logprobs=jnp.where(
      batch.response_mask, grpo.token_logprobs(TINY, params, batch.tokens, 1.0), 0.0))
  grad = jax.jit(grpo.accumulated_gradients, static_argnums=(0, 1))
  config = grpo.GRPOConfig(micro_batch_size=4, kl_coef=0.1, learner_old_logprobs=False)
  reference, _, _ = grad(TINY, config, params, exact)
  learner = dataclasses.replace(config, learner_old_logprobs=True)
  grads, metrics, _ = grad(TINY, learner, params, batch)
  # Every ratio is exp(0) = 1 exactly; the metric is their weighted float32 sum.
  assert float(metrics['ratio']) == pytest.approx(1.0, abs=1e-6)
  assert float(metrics['clip_fraction']) == 0.0
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
    # The reference's pi_old comes from an 8-row forward, the learner's from 4-row
    # micro-batches: float32 rounding of the log-probs (~1e-6) moves the ratio by as much,
    # the same 1e-5-of-the-largest-entry bound as the micro-batch test above.
    np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(r))))


def test_a_non_finite_update_is_rolled_back(tiny_params):
  params = tiny_params
  config = grpo.GRPOConfig(learning_rate=1e-2, micro_batch_size=2, learner_old_logprobs=False)
  batch = _random_batch(params)
  batch = batch.replace(advantages=batch.advantages.at[3].set(jnp.inf), ref_logprobs=None)
  opt_state = grpo.make_optimizer(config).init(params)
  new_params, new_opt_state, metrics, _ = grpo.train_step(TINY, config, params, opt_state, batch)
  assert float(metrics['update_skipped']) == 1.0 and not np.isfinite(float(metrics['loss']))
  for new, old in zip(jax.tree.leaves((new_params, new_opt_state)),
                      jax.tree.leaves((params, opt_state))):
    np.testing.assert_array_equal(new, old)
  finite = batch.replace(advantages=jnp.zeros_like(batch.advantages).at[0].set(1.0))
  _, _, metrics, _ = grpo.train_step(TINY, config, params, opt_state, finite)
  assert float(metrics['update_skipped']) == 0.0
