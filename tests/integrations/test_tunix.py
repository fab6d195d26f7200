"""SpecRoll as tunix's rollout engine: tunix's own GRPO learner trains with it for 2 steps.

Needs the optional requirements-tunix.txt (installed by .ci/run and the README's test
command). A tiny tunix Qwen2 with the stories260K tokenizer keeps it to seconds.
"""
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from experiments.tunix_grpo import grpo, make_cluster, rollout_config, tiny_qwen2
from specroll_jax.integrations.tunix import SpecRollRollout, group_runs, params_from_nnx
from specroll_jax.model.policy import Policy
from specroll_jax.rollout.compilation import compilations_so_far
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.factory import build_engine
from tests.conftest import STORIES

PROMPTS = ['Once upon a time', 'The little cat']
GROUP = 4
MAX_TOKENS, PROMPT_WIDTH = 16, 32


def _vanilla_tokens(engine: SpecRollRollout, params, seed: int) -> list[list[int]]:
  """This project's vanilla engine on the same prompts, params and seed, EOS dropped."""
  sampler = SamplerConfig(temperature=1.0)
  vanilla = build_engine(Policy(engine.config, params, None), 'vanilla', sampler)
  driver = Driver(vanilla, RolloutConfig(MAX_TOKENS, prompt_bucket_min=PROMPT_WIDTH))
  ids = [engine._tokenizer.encode(p) for p in PROMPTS]
  responses = driver.generate(vanilla.params(params), ids, GROUP, seed)
  return [r.token_ids[:-1] if r.finish_reason == 'eos' else r.token_ids for r in responses]


@pytest.fixture(scope='module')
def tokenizer():
  return AutoTokenizer.from_pretrained(str(STORIES))


def test_tunix_grpo_trains_with_specroll_rollouts(tokenizer):
  cluster = make_cluster(tiny_qwen2(), tokenizer, rollout_config(MAX_TOKENS), steps=2,
                         engine='specroll', group_size=GROUP)
  engine = cluster.rollout
  initial = engine.params
  outputs, delivered, compiled = [], [], []
  generate, update = engine.generate, engine.update_params

  def counted_generate(*args, **kwargs):
    before = compilations_so_far()
    outputs.append(generate(*args, **kwargs))
    compiled.append(compilations_so_far() - before)
    return outputs[-1]

  engine.generate = counted_generate
  engine.update_params = lambda *a, **k: update(*a, **k) or delivered.append(engine.params)
  learner = grpo(cluster, GROUP)
  assert learner.should_sync_weights  # model() is None: tunix hands over every update
  learner.train([{'prompts': np.array(PROMPTS)}] * 2)

  assert len(outputs) == 2 and len(delivered) == 2
  assert compiled[1] == 0, compiled  # the second rollout reuses every compiled program
  for out in outputs:
    assert out.left_padded_prompt_tokens.shape == (len(PROMPTS) * GROUP, PROMPT_WIDTH)
    assert all(len(t) <= MAX_TOKENS and engine.eos_id() not in t for t in out.tokens)
    assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.tokens]
  # Exact: the speculative engine's tokens are the vanilla engine's, call by call, with the
  # params each call had (the initial ones, then those tunix trained in step 1).
  first, second = ([t.tolist() for t in out.tokens] for out in outputs)
  assert first == _vanilla_tokens(engine, initial, seed=0)
  assert second == _vanilla_tokens(engine, delivered[0], seed=1)
  # The trained weights reached the engine: step 2 did not sample the initial policy.
  assert second != _vanilla_tokens(engine, initial, seed=1)


def test_converted_params_give_tunix_logits(tokenizer):
  actor = tiny_qwen2()
  engine = SpecRollRollout(actor, tokenizer, None, rollout_config(MAX_TOKENS))
  tokens = np.array([tokenizer.encode('Once upon a time there was a cat')], np.int32)
  positions = np.arange(tokens.shape[1])[None]
  mask = np.tril(np.ones((tokens.shape[1], tokens.shape[1]), bool))[None]
  theirs, _ = actor(tokens, positions, None, mask)
  ours = Policy(engine.config, engine.params, None).logits(tokens)
  # The same float32 weights in two layouts (heads as an axis vs flattened) sum in another
  # order: measured 3 ulps of the largest logit (3.6e-7 at |logit| 1.84); 16 leaves room for
  # other CPUs' kernels, while a wrong rename or reshape moves logits by O(1).
  theirs = np.asarray(theirs)
  ulp = np.spacing(np.abs(theirs).max())
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=16 * ulp)


def test_bad_use_fails_clearly(tokenizer):
  with pytest.raises(ValueError, match='adjacent runs of 2 copies'):
    group_runs(['a', 'a', 'b', 'c'], group_size=2)
  narrow = rollout_config(MAX_TOKENS, max_prompt_length=4)
  engine = SpecRollRollout(tiny_qwen2(), tokenizer, None, narrow)
  with pytest.raises(ValueError, match='more than rollout_config.max_prompt_length=4'):
    engine.generate(['Once upon a time there was'] * 2, narrow)
  with pytest.raises(ValueError, match='cannot merge'):
    engine.update_params(nnx.state(tiny_qwen2(), nnx.Param), (nnx.LoRAParam,))
  with pytest.raises(ValueError, match='maps tunix Qwen2 models'):
    SpecRollRollout(object(), tokenizer, None, rollout_config(MAX_TOKENS))
  assert params_from_nnx(nnx.state(tiny_qwen2(), nnx.Param)).keys() == engine.params.keys()
