"""Model configuration for the Llama and Qwen2 decoder families, read from HF config.json."""
import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ('LlamaForCausalLM', 'Qwen2ForCausalLM')
SUPPORTED_ROPE_TYPES = ('default', 'linear', 'llama3')
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  rope_type: str = 'default'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder; hashable so it can be a jit static argument."""
  architecture: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int
  rms_norm_eps: float
  rope: RopeConfig
  tie_word_embeddings: bool
  qkv_bias: bool
  o_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2 biases q/k/v only.
  bos_token_id: int | None
  eos_token_id: int | None
  dtype: str = 'float32'  # of the parameters
  # With bfloat16 parameters: every activation (and the KV cache) in float32, the weights
  # upcast where they are used, so tokens are decided as a float32 model would decide
  # them. False = every activation bf16. Measured against each other, and against bf16
  # matmul inputs with float32 accumulation, in experiments.measure.bf16 (notes/history.md,
  # "bfloat16: float32 decisions"). No effect in float32.
  float32_decisions: bool = True
  # 'bfloat16': every matmul takes bf16 inputs and accumulates in float32, every parameter
  # is rounded to bf16 where it is used (rollouts get the rounded copy once per update), the
  # residual stream, norms, softmax and logits are float32, and every row's result is
  # bitwise the same whatever the batch, the cache window and the program (plain step,
  # tree, prefill, learner): model/invariant.py. 'float32': today's arithmetic.
  compute_dtype: str = 'float32'
  # The KV cache's dtype; '' = the activation dtype. In the bf16 compute mode attention
  # reads keys and values as bf16 either way, so only the bytes stored differ.
  kv_cache_dtype: str = ''

  def __post_init__(self):
    for field in ('dtype', 'compute_dtype'):
      if getattr(self, field) not in _DTYPES:
        raise ValueError(f'ModelConfig.{field} must be one of {sorted(_DTYPES)}, '
                         f'got {getattr(self, field)!r}')
    if self.kv_cache_dtype not in ('',) + tuple(_DTYPES):
      raise ValueError(f"ModelConfig.kv_cache_dtype must be '' or one of {sorted(_DTYPES)}, "
                       f'got {self.kv_cache_dtype!r}')

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def batch_invariant(self) -> bool:
    """True in the bf16 compute mode, whose rows are bitwise independent of the batch."""
    return self.compute_dtype == 'bfloat16'

  @property
  def activation_dtype(self):
    """The dtype of every activation (outside the matmuls' bf16 inputs)."""
    if self.batch_invariant or self.float32_decisions:
      return jnp.float32
    return self.jnp_dtype

  @property
  def cache_dtype(self):
    return _DTYPES[self.kv_cache_dtype] if self.kv_cache_dtype else self.activation_dtype

  def with_dtype(self, dtype: str) -> 'ModelConfig':
    return dataclasses.replace(self, dtype=dtype)

  def with_compute(self, compute_dtype: str, kv_cache_dtype: str = '') -> 'ModelConfig':
    return dataclasses.replace(self, compute_dtype=compute_dtype, kv_cache_dtype=kv_cache_dtype)

  def to_hf_dict(self) -> dict:
    """The config.json transformers needs to rebuild this model."""
    rope_parameters = {'rope_type': self.rope.rope_type, 'rope_theta': self.rope.theta}
    if self.rope.rope_type == 'linear':
      rope_parameters['factor'] = self.rope.factor
    if self.rope.rope_type == 'llama3':
      rope_parameters.update(
          factor=self.rope.factor, low_freq_factor=self.rope.low_freq_factor,
          high_freq_factor=self.rope.high_freq_factor,
          original_max_position_embeddings=self.rope.original_max_position_embeddings)
    model_type = 'qwen2' if self.architecture == 'Qwen2ForCausalLM' else 'llama'
    out = {
        'architectures': [self.architecture], 'model_type': model_type,
        'vocab_size': self.vocab_size, 'hidden_size': self.hidden_size,
        'intermediate_size': self.intermediate_size, 'num_hidden_layers': self.num_layers,
        'num_attention_heads': self.num_heads, 'num_key_value_heads': self.num_kv_heads,
        'head_dim': self.head_dim, 'max_position_embeddings': self.max_position_embeddings,
        'rms_norm_eps': self.rms_norm_eps, 'rope_theta': self.rope.theta,
        'rope_parameters': rope_parameters, 'tie_word_embeddings': self.tie_word_embeddings,
        'bos_token_id': self.bos_token_id, 'eos_token_id': self.eos_token_id,
        'hidden_act': 'silu', 'torch_dtype': self.dtype,
    }
    if model_type == 'llama':
      out['attention_bias'] = self.qkv_bias
      out['mlp_bias'] = False
    return out


def _first_token_id(value):
  """HF allows a list of EOS ids; the first one is the canonical end token."""
  if isinstance(value, list):
    return value[0] if value else None
  return value


def _rope_from_hf(raw: dict, path: Path) -> RopeConfig:
  params = raw.get('rope_parameters') or raw.get('rope_scaling') or {}
  theta = float(params.get('rope_theta', raw.get('rope_theta', 10000.0)))
  rope_type = params.get('rope_type', params.get('type', 'default'))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f'{path}: rope type {rope_type!r} is not supported '
                     f'(supported: {", ".join(SUPPORTED_ROPE_TYPES)})')
  if rope_type == 'default':
    return RopeConfig(theta=theta)
  return RopeConfig(
      theta=theta, rope_type=rope_type, factor=float(params['factor']),
      low_freq_factor=float(params.get('low_freq_factor', 1.0)),
      high_freq_factor=float(params.get('high_freq_factor', 4.0)),
      original_max_position_embeddings=int(params.get('original_max_position_embeddings', 8192)))


def config_from_hf(raw: dict, path: Path, dtype: str = 'float32') -> ModelConfig:
  """Builds a ModelConfig from a parsed config.json; `path` only names the file in errors."""
  architectures = raw.get('architectures') or []
  arch = architectures[0] if architectures else None
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f'{path}: architecture {arch!r} is not supported '
                     f'(supported: {", ".join(SUPPORTED_ARCHITECTURES)})')
  if raw.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'{path}: hidden_act {raw["hidden_act"]!r} is not supported (only silu)')
  if raw.get('use_sliding_window', False):
    raise ValueError(f'{path}: use_sliding_window=true is not supported')
  if raw.get('mlp_bias', False):
    raise ValueError(f'{path}: mlp_bias=true is not supported')
  try:
    num_heads = int(raw['num_attention_heads'])
    hidden = int(raw['hidden_size'])
    llama_bias = arch == 'LlamaForCausalLM' and bool(raw.get('attention_bias', False))
    qkv_bias = arch == 'Qwen2ForCausalLM' or llama_bias
    config = ModelConfig(
        architecture=arch, vocab_size=int(raw['vocab_size']), hidden_size=hidden,
        intermediate_size=int(raw['intermediate_size']),
        num_layers=int(raw['num_hidden_layers']), num_heads=num_heads,
        num_kv_heads=int(raw.get('num_key_value_heads') or num_heads),
        head_dim=int(raw.get('head_dim') or hidden // num_heads),
        max_position_embeddings=int(raw.get('max_position_embeddings', 2048)),
        rms_norm_eps=float(raw.get('rms_norm_eps', 1e-6)), rope=_rope_from_hf(raw, path),
        tie_word_embeddings=bool(raw.get('tie_word_embeddings', False)), qkv_bias=qkv_bias,
        o_bias=llama_bias,
        bos_token_id=_first_token_id(raw.get('bos_token_id')),
        eos_token_id=_first_token_id(raw.get('eos_token_id')))
  except KeyError as e:
    raise ValueError(f'{path}: required field {e.args[0]!r} is missing') from None
  if config.num_heads % config.num_kv_heads:
    raise ValueError(f'{path}: num_attention_heads={config.num_heads} is not a multiple of '
                     f'num_key_value_heads={config.num_kv_heads}')
  return config.with_dtype(dtype)


def load_config(directory: Path, dtype: str = 'float32') -> ModelConfig:
  path = Path(directory) / 'config.json'
  if not path.is_file():
    raise FileNotFoundError(f'{path}: config.json not found')
  try:
    raw = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None
  return config_from_hf(raw, path, dtype)


def rope_inverse_frequencies(config: ModelConfig):
  """Per-dimension RoPE frequencies, including Llama-3 and linear scaling."""
  rope = config.rope
  dim = config.head_dim
  inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if rope.rope_type == 'linear':
    return inv_freq / rope.factor
  if rope.rope_type == 'llama3':
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)
  return inv_freq
