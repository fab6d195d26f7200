"""The bf16 compute mode (ModelConfig.compute_dtype): its errors and primitives, and the
batch invariance it promises on this backend, bit for bit: a row's tokens and log-probs do
not depend on the other rows, the batch bucket, the cache window, or whether a position is
computed in a plain step, inside a tree, in prefill or by the learner. Also the sampler's
law (what "lossless" rests on)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import load_policy
from specroll_jax.model import invariant
from specroll_jax.model.attention import attention_implementation
from specroll_jax.model.transformer import Transformer, compute_params
from specroll_jax.rl import grpo
from specroll_jax.rollout import sampling
from specroll_jax.rollout.compilation import count_compilations
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.oracle_proposer import OracleParams, OracleProposer
from specroll_jax.speculative.tree import TreeConfig
from tests.conftest import STORIES
from tests.tiny_models import make_checkpoint

PROMPTS = ['Once upon a time', 'The cat sat on', 'Lily and Tom went to the park to play', 'Hi']


@pytest.fixture(scope='module')
def stories_bf16_compute():
  return load_policy(STORIES, compute_dtype='bfloat16')


@pytest.mark.parametrize('field,value', [('compute_dtype', 'fp16'), ('kv_cache_dtype', 'int8'),
                                         ('dtype', 'float64')])
def test_a_bad_dtype_name_is_an_error_naming_the_field(stories_bf16_compute, field, value):
  with pytest.raises(ValueError, match=f'ModelConfig.{field} must be'):
    dataclasses.replace(stories_bf16_compute.config, **{field: value})


def test_pallas_attention_is_refused_in_bf16_compute(stories_bf16_compute):
  model = Transformer(stories_bf16_compute.config, attention_implementation('pallas'))
  tokens = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match='attention must be xla'):
    model.init(jax.random.key(0), tokens, tokens, jnp.ones((1, 2, 2), bool))


def test_pairwise_sums_are_unchanged_by_zero_padding_and_rows():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 37)), jnp.float32)
  whole = np.asarray(jax.jit(invariant.pairwise_sum)(x))
  padded = np.asarray(jax.jit(invariant.pairwise_sum)(jnp.pad(x, ((0, 0), (0, 91)))))
  alone = np.asarray(jax.jit(invariant.pairwise_sum)(x[3:4]))
  np.testing.assert_array_equal(whole, padded)
  np.testing.assert_array_equal(whole[3], alone[0])
  # The fused product tree is the same tree: bit for bit pairwise_sum(a * b) on bf16 values.
  a = x.astype(jnp.bfloat16).astype(jnp.float32)
  b = jnp.flip(a, axis=0)
  np.testing.assert_array_equal(np.asarray(jax.jit(invariant.pairwise_dot, static_argnums=2)(a, b, 1)),
                                np.asarray(jax.jit(invariant.pairwise_sum)(a * b)))


@pytest.mark.parametrize('projection', ['matmul', 'table_matmul'])
def test_projection_gradients_are_bf16_matmuls_within_their_rounding(projection):
  """The projections' gradients contract a bf16-rounded cotangent with the bf16 operands.
  Against float64 gradients of the same bf16 forward, each gradient entry g = sum_i c_i w_i
  errs by at most: the cotangent's rounding (bf16's unit roundoff is 2^-8), 2^-8 sum
  |c_i w_i|; float32 accumulation, K 2^-24 sum |c_i w_i| (K <= 64: 2^-18); the result's
  rounding to bf16, 2^-8 |g|, and |g| <= sum |c_i w_i|. So |error| <= (2^-7 + 2^-18)
  sum |c_i w_i|."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal((5, 64)).astype(np.float32)
  weight = rng.standard_normal((64, 40) if projection == 'matmul' else (40, 64)).astype(np.float32)
  cotangent = rng.standard_normal((5, 40)).astype(np.float32)
  function = getattr(invariant, projection)
  loss = lambda x, w: jnp.sum(function(x, w) * cotangent)
  grad_x, grad_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weight)
  as_bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)
  kernel = as_bf16(weight if projection == 'matmul' else weight.T)  # [K, N]
  c, xb = cotangent.astype(np.float64), as_bf16(x)
  bound = 2.0 ** -7 + 2.0 ** -18
  exact_x, scale_x = c @ kernel.T, np.abs(c) @ np.abs(kernel).T
  exact_kernel, scale_kernel = xb.T @ c, np.abs(xb).T @ np.abs(c)
  grad_kernel = np.asarray(grad_w) if projection == 'matmul' else np.asarray(grad_w).T
  assert np.all(np.abs(np.asarray(grad_x) - exact_x) <= bound * scale_x)
  assert np.all(np.abs(grad_kernel - exact_kernel) <= bound * scale_kernel)
  # The bound is not vacuous: the cotangent's rounding shows.
  assert np.any(np.asarray(grad_x) != np.asarray(exact_x, np.float32))


def test_compute_params_round_every_leaf_once(stories_bf16_compute):
  rounded = compute_params(stories_bf16_compute.config, stories_bf16_compute.params)
  assert {x.dtype for x in jax.tree.leaves(rounded)} == {jnp.dtype(jnp.bfloat16)}
  float32_config = dataclasses.replace(stories_bf16_compute.config, compute_dtype='float32')
  assert compute_params(float32_config, stories_bf16_compute.params) is stories_bf16_compute.params


def test_learner_log_probs_are_batch_invariant(stories_bf16_compute):
  """A row's logits and the learner's log-probs, bit for bit, alone and in batches of 3 and
  8 rows (right-padded to different lengths, so padding differs too)."""
  policy = stories_bf16_compute
  rng = np.random.default_rng(1)
  lengths = [30, 12, 25, 7, 30, 18, 9, 21]
  tokens = np.full((8, 30), -1, np.int32)
  for row, length in enumerate(lengths):
    tokens[row, :length] = rng.integers(3, policy.config.vocab_size, length)
  logprobs = lambda rows: np.asarray(grpo.token_logprobs(policy.config, policy.params,
                                                         jnp.asarray(rows), 1.0))
  eight, three = logprobs(tokens), logprobs(tokens[:3])
  for row in range(3):
    np.testing.assert_array_equal(eight[row], three[row])
  np.testing.assert_array_equal(eight[2], logprobs(tokens[2:3])[0])


def _rollout(policy, engine, proposer_params, prompts, max_batch, num_samples=3, max_new=40):
  config = RolloutConfig(max_new_tokens=max_new, max_batch=max_batch)
  return Driver(engine, config).generate(engine.params(policy.params, proposer_params), prompts,
                                         num_samples, 11)


def _vanilla(policy, sampler, prompts, max_batch, **kwargs):
  return _rollout(policy, VanillaEngine(policy.config, sampler, (2,)), None, prompts, max_batch,
                  **kwargs)


def _assert_bitwise(expected, actual):
  assert len(expected) == len(actual)
  for a, b in zip(expected, actual):
    assert a.token_ids == b.token_ids, (a.prompt_index, a.sample_index)
    np.testing.assert_array_equal(np.asarray(a.logprobs, np.float32),
                                  np.asarray(b.logprobs, np.float32))


def _learner_logprobs(policy, prompts, responses, temperature, rows_per_call):
  """The learner's recomputed log-probs of each response, in calls of `rows_per_call` rows
  (its micro-batches), each right-padded to the call's own width."""
  rows = [list(prompts[r.prompt_index]) + list(r.token_ids) for r in responses]
  out = []
  for first in range(0, len(rows), rows_per_call):
    chunk = rows[first:first + rows_per_call]
    tokens = np.full((len(chunk), max(map(len, chunk))), -1, np.int32)
    for i, row in enumerate(chunk):
      tokens[i, :len(row)] = row
    logprobs = np.asarray(grpo.token_logprobs(policy.config, policy.params, jnp.asarray(tokens),
                                              temperature))
    for i, r in enumerate(responses[first:first + rows_per_call]):
      start = len(prompts[r.prompt_index])
      out.append(logprobs[i, start:start + len(r.token_ids)])
  return out


def _encode(policy):
  return [policy.tokenizer.encode(t) for t in PROMPTS]


def test_rows_buckets_and_the_learner_see_the_same_bits(stories_bf16_compute):
  """A response's tokens and log-probs are bitwise the same decoded in buckets of 8 rows
  (compacting to 4, 2, 1 as rows finish) or one row at a time, and equal what the learner
  recomputes in one batch or in micro-batches of 1 and 5 rows: GRPO's ratio is exactly 1."""
  policy, sampler = stories_bf16_compute, SamplerConfig(temperature=1.0)
  prompts = _encode(policy)
  batched = _vanilla(policy, sampler, prompts, max_batch=8)
  _assert_bitwise(batched, _vanilla(policy, sampler, prompts, max_batch=1))
  for rows_per_call in (len(batched), 1, 5):
    for r, learner in zip(batched, _learner_logprobs(policy, prompts, batched, 1.0,
                                                     rows_per_call)):
      np.testing.assert_array_equal(learner, np.asarray(r.logprobs, np.float32))


def test_cache_windows_keep_the_bits(stories_bf16_compute):
  """Prompts long enough for a windowed cache (>= 256 slots): decoding moves through the
  windows, and the rollout still equals the learner's full-sequence forward."""
  policy, sampler = stories_bf16_compute, SamplerConfig(temperature=1.0)
  story = policy.tokenizer.encode(' '.join(['Once upon a time there was a little girl.'] * 24))
  prompts = [story[:200], story[:150]]
  responses = _vanilla(policy, sampler, prompts, max_batch=2, num_samples=1, max_new=72)
  assert max(len(p) + len(r.token_ids) for p, r in zip(prompts, responses)) > 256
  for r, learner in zip(responses, _learner_logprobs(policy, prompts, responses, 1.0, 2)):
    np.testing.assert_array_equal(learner, np.asarray(r.logprobs, np.float32))


def _heads_and_group_drafts(policy, sampler):
  heads_config = HeadsConfig(num_heads=3)
  heads = init_heads(heads_config, policy.config, seed=1)
  heads = dict(heads, w2=jax.random.normal(jax.random.key(2), heads['w2'].shape) * 0.3)
  proposer = HeadProposer(policy.config, heads_config, HeadDraftConfig((4, 2, 2)), sampler)
  return GroupProposer(GroupDraftConfig(chains=2, chain_depth=3, min_match=1, max_match=8,
                                        matches=8), base=proposer), heads


@pytest.mark.parametrize('sampler', [SamplerConfig(temperature=0.0),
                                     SamplerConfig(temperature=1.0),
                                     SamplerConfig(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=['greedy', 'T=1', 'top_k,top_p'])
@pytest.mark.parametrize('drafts', ['oracle', 'heads,group'])
def test_speculative_equals_vanilla_bit_for_bit(stories_bf16_compute, sampler, drafts):
  """Trees (the oracle's deep chains; branched head trees merged with group drafts, whose
  siblings share positions) emit vanilla's tokens and log-probs bit for bit."""
  policy = stories_bf16_compute
  prompts = _encode(policy)
  vanilla = _vanilla(policy, sampler, prompts, max_batch=8)
  if drafts == 'oracle':
    future = np.zeros((len(vanilla), 40), np.int32)
    for i, r in enumerate(vanilla):
      future[i, :len(r.token_ids)] = r.token_ids
    proposer, params = OracleProposer(4), OracleParams(None, jnp.asarray(future))
  else:
    proposer, params = _heads_and_group_drafts(policy, sampler)
  engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=64, max_nodes=16),
                      sampler, (2,))
  spec = _rollout(policy, engine, params, prompts, max_batch=8)
  _assert_bitwise(vanilla, spec)
  if drafts == 'oracle':
    assert sum(len(s.token_ids) for s in spec) > 2 * sum(s.steps for s in spec)
    with count_compilations() as compiled:
      _rollout(policy, engine, params, prompts, max_batch=8)
      assert compiled() == 0


def test_grouped_queries_and_untied_projection_bit_for_bit(tmp_path):
  """Four query heads per kv head, head_dim 16 (a contraction padded to 32) and an untied
  vocabulary projection: vanilla at 8 rows and at 1, and the oracle's trees, agree."""
  make_checkpoint(tmp_path, 'qwen2_untied_gqa4', seed=3, initializer_range=0.25)
  policy = load_policy(tmp_path, compute_dtype='bfloat16')
  sampler, prompts = SamplerConfig(temperature=1.0), _encode(policy)
  vanilla = _vanilla(policy, sampler, prompts, max_batch=8, max_new=24)
  _assert_bitwise(vanilla, _vanilla(policy, sampler, prompts, max_batch=1, max_new=24))
  future = np.zeros((len(vanilla), 24), np.int32)
  for i, r in enumerate(vanilla):
    future[i, :len(r.token_ids)] = r.token_ids
  engine = SpecEngine(policy.config, OracleProposer(4), TreeConfig(capacity_tokens=64,
                                                                   max_nodes=16), sampler, (2,))
  _assert_bitwise(vanilla, _rollout(policy, engine, OracleParams(None, jnp.asarray(future)),
                                    prompts, max_batch=8, max_new=24))


@pytest.mark.parametrize('sampler', [SamplerConfig(temperature=1.0), SamplerConfig(top_k=5),
                                     SamplerConfig(temperature=1.3, top_p=0.8)],
                         ids=['T=1', 'top_k', 'T=1.3,top_p'])
def test_draws_follow_the_samplers_law(sampler):
  """Lossless means the draws are samples of S(logits): 40,000 draws over a 37-token
  vocabulary (blocks of 8, the last one partial) against the exact probabilities, by
  Pearson's chi-square at p = 1e-4 (deterministic keys: the statistic is fixed)."""
  logits = jnp.asarray(np.random.default_rng(3).standard_normal(37), jnp.float32)
  keys = jax.random.split(jax.random.key(5), 40_000)
  draws = np.asarray(jax.jit(lambda k: sampling.draw(jnp.broadcast_to(logits, (k.shape[0], 37)),
                                                     k, sampler))(keys))
  expected = np.asarray(sampling.distribution(logits, sampler), np.float64) * len(draws)
  observed = np.bincount(draws, minlength=37)
  support = expected > 0
  assert observed[~support].sum() == 0
  chi2 = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
  dof = support.sum() - 1
  assert dof >= 4  # the sampler keeps several tokens: the test can tell laws apart
  # Wilson-Hilferty: the chi-square quantile at 1 - 1e-4 (z = 3.719).
  bound = dof * (1 - 2 / (9 * dof) + 3.719 * np.sqrt(2 / (9 * dof))) ** 3
  assert chi2 < bound, (chi2, bound)
