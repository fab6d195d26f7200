"""Logits parity with transformers (torch, float32) and HF save/load round trips."""
import json

import numpy as np
import pytest
import torch
import transformers

from specroll_jax import load_policy
from tests.conftest import STORIES
from tests.tiny_models import VARIANTS, make_checkpoint

TOLERANCE = 1e-4  # fp32 rounding differences between XLA and torch kernels.


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_random_tiny_models_match_transformers(tmp_path, variant):
  model = make_checkpoint(tmp_path, variant)
  ids = np.random.default_rng(0).integers(0, 512, size=(2, 40))
  ours = np.asarray(load_policy(tmp_path).logits(ids))
  assert np.abs(ours - _torch_logits(model, ids)).max() <= TOLERANCE


def test_stories260k_matches_transformers_and_reference(stories_policy):
  reference = json.loads((STORIES / 'reference_logits.json').read_text())
  ids = np.array([reference['input_ids']])
  ours = np.asarray(stories_policy.logits(ids))[0]
  assert np.abs(ours - np.array(reference['logits'])).max() <= TOLERANCE
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32)
  story = np.random.default_rng(1).integers(3, 512, size=(1, 128))
  assert np.abs(np.asarray(stories_policy.logits(story)) - _torch_logits(hf, story)).max() <= TOLERANCE


def test_saved_policy_loads_in_transformers_and_back(tmp_path, stories_policy):
  stories_policy.save(tmp_path)
  ids = np.array([[1, 403, 407, 261, 378, 432, 383]])
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert np.abs(np.asarray(stories_policy.logits(ids)) - _torch_logits(hf, ids)).max() <= TOLERANCE
  reloaded = load_policy(tmp_path)
  np.testing.assert_array_equal(np.asarray(reloaded.logits(ids)),
                                np.asarray(stories_policy.logits(ids)))
  assert reloaded.tokenizer.encode('Once upon a time') == [1, 403, 407, 261, 378]


def test_bfloat16_policy_tracks_float32(stories_policy):
  ids = np.array([[1, 403, 407, 261, 378, 432, 383, 286]])
  bf16 = load_policy(STORIES, dtype='bfloat16')
  assert bf16.params['embed_tokens']['embedding'].dtype == np.dtype('bfloat16')
  f32_logits = np.asarray(stories_policy.logits(ids))
  bf16_logits = np.asarray(bf16.logits(ids))
  # bf16 keeps 8 mantissa bits: logits of magnitude ~20 move by a few tenths; the argmax
  # along this prompt has margins far larger than that.
  assert np.abs(bf16_logits - f32_logits).max() < 1.0
  np.testing.assert_array_equal(bf16_logits.argmax(-1), f32_logits.argmax(-1))
