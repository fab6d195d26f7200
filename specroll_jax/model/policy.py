"""The policy: config + params + tokenizer, loaded from and saved to HF directories."""
import dataclasses
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from specroll_jax.model import checkpoint
from specroll_jax.model.config import ModelConfig, load_config
from specroll_jax.model.transformer import Transformer, causal_mask


@dataclasses.dataclass
class Policy:
  config: ModelConfig
  params: dict
  tokenizer: object

  def logits(self, token_ids) -> jax.Array:
    """Full-sequence forward: int [B, T] -> float32 logits [B, T, V]."""
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 2:
      raise ValueError(f'token_ids must be [batch, time], got shape {token_ids.shape}')
    return full_sequence_logits(self.config, self.params, token_ids)

  @property
  def eos_ids(self) -> tuple:
    """The token ids that end a response (none when config.json names no EOS)."""
    return () if self.config.eos_token_id is None else (self.config.eos_token_id,)

  def prompt_ids(self, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: raw text for base models, or (chat_template) `text` as one user
    turn through the tokenizer's chat template, ending where the assistant's reply starts."""
    if not chat_template:
      return self.tokenizer.encode(text)
    if not getattr(self.tokenizer, 'chat_template', None):
      raise ValueError(f'{self.tokenizer.name_or_path}: chat_template requested but this '
                       'tokenizer has none (a base model: use raw prompts)')
    return list(self.tokenizer.apply_chat_template([{'role': 'user', 'content': text}],
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)['input_ids'])

  def save(self, directory) -> None:
    checkpoint.save_params(Path(directory), self.config, self.params)
    if self.tokenizer is not None:
      self.tokenizer.save_pretrained(str(directory))


@partial(jax.jit, static_argnums=0)
def full_sequence_logits(config: ModelConfig, params, token_ids):
  batch, t_len = token_ids.shape
  positions = jnp.broadcast_to(jnp.arange(t_len), (batch, t_len))
  mask = causal_mask(jnp.ones((batch, t_len), bool))
  model = Transformer(config)
  hidden, _ = model.apply({'params': params}, token_ids, positions, mask)
  return model.apply({'params': params}, hidden, method=Transformer.project)


def load_tokenizer(directory: Path, config: ModelConfig):
  from transformers import AutoTokenizer  # Heavy import, only needed when a tokenizer is read.
  try:
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
  except (OSError, ValueError) as e:
    raise FileNotFoundError(f'{directory}: no loadable tokenizer ({e})') from None
  if len(tokenizer) > config.vocab_size:
    raise ValueError(f'{directory}: tokenizer has {len(tokenizer)} tokens but the embedding '
                     f'table (config.json vocab_size) has only {config.vocab_size} rows')
  return tokenizer


def load_policy(path, dtype: str = 'float32', with_tokenizer: bool = True,
                compute_dtype: str = 'float32', kv_cache_dtype: str = '') -> Policy:
  """Loads an HF-format Llama/Qwen2 directory (config.json, *.safetensors, tokenizer);
  `dtype` is the parameters', `compute_dtype` the matmuls' (ModelConfig)."""
  directory = Path(path)
  if not directory.is_dir():
    raise FileNotFoundError(f'{directory}: checkpoint directory does not exist')
  config = load_config(directory, dtype).with_compute(compute_dtype, kv_cache_dtype)
  params = checkpoint.load_params(directory, config)
  tokenizer = load_tokenizer(directory, config) if with_tokenizer else None
  return Policy(config=config, params=params, tokenizer=tokenizer)
