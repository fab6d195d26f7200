"""GGUF import on a tiny Llama GGUF written here with the gguf package (not the 93 MB file)."""
import json

import gguf
import numpy as np
import pytest
import torch
import transformers

from experiments import import_gguf
from specroll_jax import load_policy

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 32, 48, 2, 4, 2
VOCAB = (['<unk>', '<s>', '</s>'] + [chr(c) for c in range(97, 123)] + ['\u2581']
         + ['\u2581' + chr(c) for c in range(97, 123)])


def write_tiny_gguf(path, seed=0):
  """A random float32 Llama with a sentencepiece-style vocabulary, as llama.cpp lays it out."""
  rng = np.random.default_rng(seed)
  tensor = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
  writer = gguf.GGUFWriter(str(path), 'llama')
  writer.add_context_length(128)
  writer.add_embedding_length(HIDDEN)
  writer.add_block_count(LAYERS)
  writer.add_feed_forward_length(INTER)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model('llama')
  writer.add_token_list(VOCAB)
  writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(VOCAB) - 3)])
  writer.add_token_types([2, 3, 3] + [1] * (len(VOCAB) - 3))
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  head_dim = HIDDEN // HEADS
  writer.add_tensor('token_embd.weight', tensor(len(VOCAB), HIDDEN))
  writer.add_tensor('output_norm.weight', 1 + tensor(HIDDEN))
  writer.add_tensor('output.weight', tensor(len(VOCAB), HIDDEN))
  for i in range(LAYERS):
    for name, shape in (('attn_norm', (HIDDEN,)), ('ffn_norm', (HIDDEN,)),
                        ('attn_q', (HEADS * head_dim, HIDDEN)),
                        ('attn_k', (KV_HEADS * head_dim, HIDDEN)),
                        ('attn_v', (KV_HEADS * head_dim, HIDDEN)),
                        ('attn_output', (HIDDEN, HEADS * head_dim)),
                        ('ffn_gate', (INTER, HIDDEN)), ('ffn_up', (INTER, HIDDEN)),
                        ('ffn_down', (HIDDEN, INTER))):
      value = tensor(*shape) + (1 if name.endswith('norm') else 0)
      writer.add_tensor(f'blk.{i}.{name}.weight', value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_import_matches_transformers_and_is_idempotent(tmp_path):
  source = write_tiny_gguf(tmp_path / 'tiny.gguf')
  out = tmp_path / 'policy'
  record = import_gguf.import_gguf(source, out)
  policy = load_policy(out)
  assert policy.config.vocab_size == len(VOCAB) and policy.config.num_layers == LAYERS
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file='tiny.gguf',
                                                            dtype=torch.float32)
  ids = policy.tokenizer('hello world')['input_ids']
  with torch.no_grad():
    reference = model(torch.tensor([ids])).logits[0].numpy()
  ours = np.asarray(policy.logits([ids])[0])
  # A 2-layer float32 model: XLA and torch differ only in reduction order, measured 3.5e-6
  # here and 8.8e-6 on the import's own check prompt (logits up to 4.6); a wrong conversion
  # (a transposed or unpermuted matrix) moves logits by O(1).
  np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
  assert record['max_abs_logit_diff'] <= 1e-5
  written = (out / 'model.safetensors').stat().st_mtime_ns
  assert import_gguf.import_gguf(source, out) == record
  assert (out / 'model.safetensors').stat().st_mtime_ns == written
  assert json.loads((out / import_gguf.IMPORT_RECORD).read_text())['gguf_sha256'] == (
      import_gguf.file_digest(source))


def test_bad_inputs_are_clear_errors(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match='missing.gguf: GGUF file not found'):
    import_gguf.import_gguf(tmp_path / 'missing.gguf', tmp_path / 'out')
  (tmp_path / 'text.gguf').write_text('not a model')
  with pytest.raises(ValueError, match='text.gguf: not a GGUF file'):
    import_gguf.import_gguf(tmp_path / 'text.gguf', tmp_path / 'out')
  truncated = write_tiny_gguf(tmp_path / 'full.gguf').read_bytes()[:2000]
  (tmp_path / 'truncated.gguf').write_bytes(truncated)
  with pytest.raises(ValueError, match='truncated.gguf: transformers cannot read this GGUF'):
    import_gguf.import_gguf(tmp_path / 'truncated.gguf', tmp_path / 'out')
  assert not (tmp_path / 'out').exists()
  monkeypatch.setattr(import_gguf, 'REQUIRED_MODULES', ('torch', 'no_such_gguf_reader'))
  with pytest.raises(ImportError, match='needs no_such_gguf_reader'):
    import_gguf.import_gguf(tmp_path / 'full.gguf', tmp_path / 'out')
