"""Each bad checkpoint raises an error that names the culprit."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specroll_jax import load_policy
from specroll_jax.model.config import load_config
from specroll_jax.speculative.heads import HEADS_FILE, HeadsConfig, init_heads, load_heads, save_heads
from tests.conftest import STORIES


@pytest.fixture
def checkpoint(tmp_path):
  directory = tmp_path / 'ckpt'
  shutil.copytree(STORIES, directory)
  return directory


def _edit_config(directory, **changes):
  path = directory / 'config.json'
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def _edit_tensors(directory, edit):
  path = directory / 'model.safetensors'
  tensors = load_file(str(path))
  edit(tensors)
  save_file(tensors, str(path))


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match='nowhere.*does not exist'):
    load_policy(tmp_path / 'nowhere')


def test_missing_config(checkpoint):
  (checkpoint / 'config.json').unlink()
  with pytest.raises(FileNotFoundError, match='config.json not found'):
    load_policy(checkpoint)


def test_missing_weights(checkpoint):
  (checkpoint / 'model.safetensors').unlink()
  with pytest.raises(FileNotFoundError, match=r'no \*.safetensors'):
    load_policy(checkpoint)


def test_unsupported_architecture(checkpoint):
  _edit_config(checkpoint, architectures=['GPT2LMHeadModel'])
  with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
    load_policy(checkpoint)


def test_wrong_tensor_shape(checkpoint):
  def shrink(t):
    t['model.layers.3.mlp.up_proj.weight'] = t['model.layers.3.mlp.up_proj.weight'][:-1]
  _edit_tensors(checkpoint, shrink)
  with pytest.raises(ValueError, match=r"'model.layers.3.mlp.up_proj.weight' has shape \(171, 64\)"):
    load_policy(checkpoint)


def test_missing_tensor(checkpoint):
  _edit_tensors(checkpoint, lambda t: t.pop('model.layers.2.self_attn.k_proj.weight'))
  with pytest.raises(ValueError, match='model.layers.2.self_attn.k_proj.weight'):
    load_policy(checkpoint)


def test_unexpected_tensor(checkpoint):
  def add(t):
    t['model.layers.0.self_attn.o_proj.bias'] = np.zeros(64, np.float32)
  _edit_tensors(checkpoint, add)
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
    load_policy(checkpoint)


def test_tokenizer_larger_than_embedding(checkpoint):
  _edit_config(checkpoint, vocab_size=256)
  def shrink(t):
    t['model.embed_tokens.weight'] = t['model.embed_tokens.weight'][:256]
  _edit_tensors(checkpoint, shrink)
  with pytest.raises(ValueError, match='tokenizer has 512 tokens.*only 256 rows'):
    load_policy(checkpoint)


def test_unsupported_rope(checkpoint):
  _edit_config(checkpoint, rope_parameters={'rope_type': 'yarn', 'factor': 2.0})
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    load_policy(checkpoint)


def _truncate(path):
  with path.open('r+b') as f:
    f.truncate(path.stat().st_size // 2)


def test_truncated_weights_are_named(checkpoint):
  _truncate(checkpoint / 'model.safetensors')
  with pytest.raises(ValueError, match=r'model\.safetensors: not a readable safetensors file'):
    load_policy(checkpoint)


def test_truncated_heads_are_named(tmp_path):
  model_config = load_config(STORIES)
  heads_config = HeadsConfig(num_heads=2)
  save_heads(tmp_path, heads_config, init_heads(heads_config, model_config))
  _truncate(tmp_path / HEADS_FILE)
  with pytest.raises(ValueError, match=r'heads\.safetensors: not a readable safetensors file'):
    load_heads(tmp_path, model_config)
