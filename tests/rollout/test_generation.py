"""The vanilla engine: reference output, cache/forward agreement, batching and compilation."""
import json

import jax
import numpy as np
import pytest

from specroll_jax.rollout.buckets import prompt_bucket
from specroll_jax.rollout.compilation import count_compilations
from specroll_jax.rollout.driver import Driver, FINISH_EOS, FINISH_LENGTH, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from tests.conftest import STORIES

PROMPTS = ['Once upon a time', 'The cat sat', 'Lily and Tom went to the park to play', 'Hi']


def _generate(policy, sampler, prompts, num_samples=1, max_new=24, max_batch=8, seed=0,
              eos_ids=(2,), buckets_per_octave=1):
  engine = VanillaEngine(policy.config, sampler, eos_ids)
  driver = Driver(engine, RolloutConfig(max_new_tokens=max_new, max_batch=max_batch,
                                        prompt_buckets_per_octave=buckets_per_octave))
  return driver.generate(policy.params, prompts, num_samples, seed)


def _encode(policy, texts):
  return [policy.tokenizer.encode(t) for t in texts]


def test_greedy_reproduces_reference_continuation(stories_policy):
  reference = json.loads((STORIES / 'reference_greedy.json').read_text())
  [out] = _generate(stories_policy, SamplerConfig(temperature=0.0), [reference['prompt_ids']],
                    max_new=200, max_batch=1)
  assert out.token_ids == reference['output_ids']
  assert out.finish_reason == FINISH_LENGTH
  assert stories_policy.tokenizer.decode(out.token_ids) == reference['text']


@pytest.mark.parametrize('sampler', [SamplerConfig(temperature=0.0),
                                     SamplerConfig(temperature=1.0, top_k=20, top_p=0.9)])
def test_cached_decode_equals_full_sequence_forward(stories_policy, sampler):
  prompts = _encode(stories_policy, PROMPTS)
  outs = _generate(stories_policy, sampler, prompts, num_samples=2)
  for out in outs:
    prompt = prompts[out.prompt_index]
    ids = np.array([prompt + out.token_ids])
    logits = np.asarray(stories_policy.logits(ids))[0, len(prompt) - 1:-1]
    scale = 1.0 if sampler.greedy else sampler.temperature
    logp = jax.nn.log_softmax(logits / scale, axis=-1)
    expected = np.take_along_axis(np.asarray(logp), np.array(out.token_ids)[:, None], -1)[:, 0]
    # The cached decode reduces over a padded cache, the full forward over the exact length, so
    # the float32 sums differ in order, and by how much depends on the CPU's vector width: a
    # sampled low-probability token does not cancel its logit's error against the logsumexp's.
    # Measured worst case: 7.2 ulps of the largest logit (1.4e-5 at |logit| 20.3, 6 seeds); a
    # stale or shifted cache entry moves log-probs by more than 1e-2.
    ulp = np.spacing(np.float32(np.abs(logits).max()))
    np.testing.assert_allclose(out.logprobs, expected, rtol=0, atol=16 * ulp)
    if sampler.greedy:
      assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_prompt_lengths_equal_each_prompt_alone(stories_policy):
  sampler = SamplerConfig(temperature=1.0)
  prompts = _encode(stories_policy, PROMPTS)
  together = _generate(stories_policy, sampler, prompts, num_samples=2)
  for out in together:
    # Response id r = p * G + s names the RNG stream; alone, the prompt must sit at the same r.
    padded = [prompts[out.prompt_index]] * (out.prompt_index + 1)
    alone = _generate(stories_policy, sampler, padded, num_samples=2, max_batch=8)
    match = alone[out.prompt_index * 2 + out.sample_index]
    assert match.token_ids == out.token_ids


def test_prompt_buckets_pad_to_the_next_step_of_their_octave():
  widths = {n: prompt_bucket(n, 16, 4) for n in (1, 16, 17, 33, 64, 65, 169, 193, 257)}
  assert widths == {1: 16, 16: 16, 17: 20, 33: 40, 64: 64, 65: 80, 169: 192, 193: 224,
                    257: 320}
  assert [prompt_bucket(n, 16, 1) for n in (17, 33, 169)] == [32, 64, 256]
  with pytest.raises(ValueError, match='buckets_per_octave=3'):
    prompt_bucket(40, 16, 3)


def test_finer_prompt_buckets_emit_the_same_responses(stories_policy):
  # 21 tokens: a 24-slot prompt bucket at four per octave, 32 at one.
  prompts = _encode(stories_policy, PROMPTS[:2] + [' '.join(['the dog ran'] * 4)])
  assert max(len(p) for p in prompts) == 21
  sampler = SamplerConfig(temperature=0.0)
  coarse = _generate(stories_policy, sampler, prompts)
  fine = _generate(stories_policy, sampler, prompts, buckets_per_octave=4)
  assert [o.token_ids for o in fine] == [o.token_ids for o in coarse]
  for a, b in zip(fine, coarse):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_top_k_one_equals_greedy(stories_policy):
  prompts = _encode(stories_policy, PROMPTS)
  greedy = _generate(stories_policy, SamplerConfig(temperature=0.0), prompts)
  top1 = _generate(stories_policy, SamplerConfig(temperature=0.8, top_k=1), prompts)
  assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_eos_ends_a_response_where_it_is_drawn(stories_policy):
  prompts = _encode(stories_policy, PROMPTS)
  free = _generate(stories_policy, SamplerConfig(temperature=0.0), prompts)
  # Declare the 5th greedy token of the first response an EOS token: it must stop there.
  eos = free[0].token_ids[4]
  stopped = _generate(stories_policy, SamplerConfig(temperature=0.0), prompts, eos_ids=(eos,))
  assert stopped[0].token_ids == free[0].token_ids[:5]
  assert stopped[0].finish_reason == FINISH_EOS
  for out, ref in zip(stopped, free):
    cut = ref.token_ids.index(eos) + 1 if eos in ref.token_ids else len(ref.token_ids)
    assert out.token_ids == ref.token_ids[:cut]


def test_segments_account_for_every_token_and_step_by_bucket(stories_policy):
  """The driver's per-bucket timing (the benchmarks' tail figures) covers the whole rollout."""
  engine = VanillaEngine(stories_policy.config, SamplerConfig(temperature=1.0), (2,))
  driver = Driver(engine, RolloutConfig(max_new_tokens=24, max_batch=16))
  segments = []
  out = driver.generate(stories_policy.params, _encode(stories_policy, PROMPTS[:3]), 4, 0,
                        segments=segments)
  assert [s.batch for s in segments] == sorted({s.batch for s in segments}, reverse=True)
  assert segments[0].batch == 16 and segments[0].running == 12
  assert all(s.running <= s.batch and s.seconds > 0 for s in segments)
  assert sum(s.tokens for s in segments) == sum(len(r.token_ids) for r in out)
  assert sum(s.row_steps for s in segments) == sum(r.steps for r in out)


def test_no_recompilation_in_steady_state(stories_policy):
  sampler = SamplerConfig(temperature=1.0, top_p=0.95)
  first = _encode(stories_policy, PROMPTS)
  second = _encode(stories_policy, ['A dog', 'The sun was hot and bright', 'Tim', 'Sue ran'])
  _generate(stories_policy, sampler, first, num_samples=3, max_batch=8)
  with count_compilations() as compiled:
    _generate(stories_policy, sampler, second, num_samples=3, max_batch=8, seed=7)
    assert compiled() == 0


def test_prompt_too_long_for_the_model_is_a_clear_error(stories_policy):
  with pytest.raises(ValueError, match='prompt 1 has 500 tokens'):
    _generate(stories_policy, SamplerConfig(), [[1, 2], [5] * 500], max_new=20)


def test_windowed_decode_equals_full_sequence_forward(stories_policy):
  # 16 prompt slots + 240 new tokens: a 256-slot cache, read through four windows as it fills.
  greedy = SamplerConfig(temperature=0.0)
  [out] = _generate(stories_policy, greedy, [[1]], max_new=240, max_batch=1, eos_ids=())
  assert len(out.token_ids) == 240
  ids = np.array([[1] + out.token_ids])
  logits = np.asarray(stories_policy.logits(ids))[0, :-1]
  assert out.token_ids == logits.argmax(-1).tolist()
  expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, axis=-1)),
                                np.array(out.token_ids)[:, None], -1)[:, 0]
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-5)
  with count_compilations() as compiled:  # window changes inside the loop compile nothing
    _generate(stories_policy, greedy, [[1, 400]], max_new=240, max_batch=1, eos_ids=())
    assert compiled() == 0
