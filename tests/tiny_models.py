"""Random tiny HF checkpoints written by transformers itself, for parity tests."""
import shutil

import torch
import transformers

from tests.conftest import STORIES

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json')

LLAMA_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2)

VARIANTS = {
    'llama_tied_gqa2': ('llama', dict(tie_word_embeddings=True)),
    'llama_untied_mha_bias': ('llama', dict(tie_word_embeddings=False, num_key_value_heads=4,
                                            attention_bias=True)),
    'llama3_rope_gqa4': ('llama', dict(tie_word_embeddings=False, num_key_value_heads=1,
                                       rope_parameters=dict(
                                           rope_type='llama3', rope_theta=500000.0, factor=8.0,
                                           low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=32))),
    'qwen2_tied': ('qwen2', dict(tie_word_embeddings=True)),
    'qwen2_untied_gqa4': ('qwen2', dict(tie_word_embeddings=False, num_key_value_heads=1)),
}


def make_checkpoint(directory, variant: str, seed: int = 0, initializer_range: float = 0.02):
  """Writes a randomly initialised HF model of `variant` plus stories260K's tokenizer.

  A larger `initializer_range` gives peaked next-token distributions like a trained model's.
  """
  family, overrides = VARIANTS[variant]
  torch.manual_seed(seed)
  kwargs = dict(LLAMA_BASE, initializer_range=initializer_range, **overrides)
  if family == 'llama':
    config = transformers.LlamaConfig(**kwargs)
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.Qwen2Config(**kwargs)
    model = transformers.Qwen2ForCausalLM(config)
  with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them too.
    for name, param in model.named_parameters():
      if 'norm' in name or 'bias' in name:
        param.add_(0.1 * torch.randn_like(param))
  model.eval()
  model.save_pretrained(str(directory))
  for name in TOKENIZER_FILES:
    shutil.copy(STORIES / name, directory / name)
  return model
