"""Pure-functional Flax decoder for the Llama and Qwen2 families.

One forward serves every use: a block of tokens with explicit positions attends to the
cached prefix of its row plus the block itself through an explicit block mask (see
attention.py). It returns the final post-norm hidden states and the block's keys/values;
the caller decides what to commit to the cache (kv_cache.commit) and which hidden states
to project to logits (`Transformer.project`).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from specroll_jax.model import invariant
from specroll_jax.model.attention import block_attention, invariant_block_attention
from specroll_jax.model.config import ModelConfig, rope_inverse_frequencies
from specroll_jax.model.kv_cache import BlockKV, KVCache


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype        # of the output
  param_dtype: jnp.dtype
  batch_invariant: bool = False

  @nn.compact
  def __call__(self, x):
    weight = self.param('weight', nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    if self.batch_invariant:
      return invariant.rms_norm(x, weight, self.eps)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return weight.astype(self.dtype) * x32.astype(self.dtype)


class InvariantDense(nn.Module):
  """nn.Dense's parameters (kernel [in, out], bias) with bf16 inputs, float32 accumulation
  and output, and rows bitwise independent of the batch (invariant.matmul)."""
  features: int
  use_bias: bool
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features), self.param_dtype)
    y = invariant.matmul(x, kernel)
    if self.use_bias:
      bias = self.param('bias', nn.initializers.zeros, (self.features,), self.param_dtype)
      y = y + bias.astype(invariant.BF16).astype(jnp.float32)
    return y


def dense(config: ModelConfig, features: int, bias: bool, name: str) -> nn.Module:
  """A projection with the model's parameters, computed in the activation dtype (or, in the
  bf16 compute mode, from bf16 inputs into float32)."""
  if config.batch_invariant:
    return InvariantDense(features, bias, config.jnp_dtype, name=name)
  return nn.Dense(features, use_bias=bias, dtype=config.activation_dtype,
                  param_dtype=config.jnp_dtype, name=name)


def norm(config: ModelConfig, name: str | None = None) -> RMSNorm:
  return RMSNorm(config.rms_norm_eps, config.activation_dtype, config.jnp_dtype,
                 config.batch_invariant, name=name)


def compute_params(config: ModelConfig, params):
  """The parameters as the compute mode reads them: in bf16 compute every leaf rounded to
  bf16 (what rollouts take, once per update, so no step converts weights); else unchanged.
  The learner keeps float32 masters and rounds them inside its forward, to the same bits."""
  if not config.batch_invariant:
    return params
  return jax.tree.map(lambda x: x.astype(invariant.BF16), params)


def rope_tables(positions, config: ModelConfig):
  """cos/sin [B, T, 1, Dh] for `positions` [B, T], computed once per forward for all layers."""
  angles = positions[..., None].astype(jnp.float32) * rope_inverse_frequencies(config)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
  """Rotary embedding in the HF 'rotate_half' layout; x: [B, T, H, Dh]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class Attention(nn.Module):
  config: ModelConfig
  attention_fn: object

  @nn.compact
  def __call__(self, x, rope, block_mask, k_cache, v_cache, cache_lengths):
    c = self.config
    batch, t_len, _ = x.shape
    q = dense(c, c.num_heads * c.head_dim, c.qkv_bias, 'q_proj')(x)
    k = dense(c, c.num_kv_heads * c.head_dim, c.qkv_bias, 'k_proj')(x)
    v = dense(c, c.num_kv_heads * c.head_dim, c.qkv_bias, 'v_proj')(x)
    q = q.reshape(batch, t_len, c.num_heads, c.head_dim)
    k = k.reshape(batch, t_len, c.num_kv_heads, c.head_dim)
    v = v.reshape(batch, t_len, c.num_kv_heads, c.head_dim)
    rotate = invariant.rope if c.batch_invariant else apply_rope
    q, k = rotate(q, *rope), rotate(k, *rope).astype(c.cache_dtype)
    v = v.astype(c.cache_dtype)  # what the cache will hold, so block and cache agree
    out = self.attention_fn(q, k_cache, v_cache, cache_lengths, k, v, block_mask,
                            scale=c.head_dim ** -0.5)
    out = dense(c, c.hidden_size, c.o_bias, 'o_proj')(out.reshape(batch, t_len, -1))
    return out, k, v


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    gate = dense(c, c.intermediate_size, False, 'gate_proj')(x)
    up = dense(c, c.intermediate_size, False, 'up_proj')(x)
    return dense(c, c.hidden_size, False, 'down_proj')(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  config: ModelConfig
  attention_fn: object

  @nn.compact
  def __call__(self, x, rope, block_mask, k_cache, v_cache, cache_lengths):
    c = self.config
    h = norm(c, 'input_layernorm')(x)
    attn, k, v = Attention(c, self.attention_fn, name='self_attn')(
        h, rope, block_mask, k_cache, v_cache, cache_lengths)
    x = x + attn
    h = norm(c, 'post_attention_layernorm')(x)
    return x + MLP(c, name='mlp')(h), k, v


class Transformer(nn.Module):
  """Decoder; `__call__` runs a query block, `project` maps hidden states to logits."""
  config: ModelConfig
  attention_fn: object = block_attention

  def setup(self):
    c = self.config
    attention_fn = self.attention_fn
    if c.batch_invariant:
      if attention_fn is not block_attention:
        raise ValueError('ModelConfig.compute_dtype=bfloat16 needs the XLA attention: the '
                         'Pallas kernel is not batch-invariant (attention must be xla)')
      attention_fn = invariant_block_attention
    self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.activation_dtype,
                                 param_dtype=c.jnp_dtype)
    self.layers = [DecoderLayer(c, attention_fn, name=f'layers_{i}')
                   for i in range(c.num_layers)]
    self.norm = norm(c)
    if not c.tie_word_embeddings:
      self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=c.activation_dtype,
                              param_dtype=c.jnp_dtype)

  def __call__(self, tokens, positions, block_mask, cache: KVCache | None = None):
    """Runs a block of tokens [B, T] at `positions` [B, T] with `block_mask` [B, T, T].

    Returns (hidden [B, T, D] after the final norm, BlockKV of the block).
    """
    c = self.config
    batch = tokens.shape[0]
    if cache is None:
      cache = KVCache.zeros(c, batch, 0)
    x = self.embed(tokens) if c.batch_invariant else self.embed_tokens(tokens)
    rope = rope_tables(positions, c)
    ks, vs = [], []
    for i, layer in enumerate(self.layers):
      x, k, v = layer(x, rope, block_mask, cache.k[i], cache.v[i], cache.lengths)
      ks.append(k)
      vs.append(v)
    return self.norm(x), BlockKV(k=tuple(ks), v=tuple(vs))

  def project(self, hidden):
    """float32 logits through the (possibly tied) vocabulary projection."""
    if self.config.batch_invariant:
      if self.config.tie_word_embeddings:
        return invariant.table_matmul(hidden, self.embed_tokens.embedding)
      return invariant.matmul(hidden, self.lm_head.variables['params']['kernel'])
    if self.config.tie_word_embeddings:
      logits = self.embed_tokens.attend(hidden)
    else:
      logits = self.lm_head(hidden)
    return logits.astype(jnp.float32)

  def embed(self, ids):
    """float32 input embeddings of token ids [...] -> [..., D] (bf16-rounded in bf16 compute)."""
    if self.config.batch_invariant:
      return self.embed_tokens.embedding.astype(invariant.BF16)[ids].astype(jnp.float32)
    return self.embed_tokens(ids).astype(jnp.float32)

  def vocab_rows(self, ids):
    """float32 rows W[ids] [..., D] of the vocabulary projection (logit of v = W[v] . h)."""
    if self.config.tie_word_embeddings:
      rows = self.embed_tokens.embedding[ids]
    else:
      rows = self.lm_head.variables['params']['kernel'].T[ids]
    return rows.astype(jnp.float32)


def causal_mask(valid: jax.Array) -> jax.Array:
  """[B, T] validity -> [B, T, T] causal mask that also hides padded keys."""
  t_len = valid.shape[1]
  tril = jnp.tril(jnp.ones((t_len, t_len), bool))
  return tril[None] & valid[:, None, :]


def _padded_inputs(tokens):
  """Right-padded rows (-1 = padding) as a full-sequence forward takes them: (tokens with
  padding as 0, positions, causal mask hiding padded keys, valid mask [B, T])."""
  batch, width = tokens.shape
  valid = tokens >= 0
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  return jnp.where(valid, tokens, 0), positions, causal_mask(valid), valid


def padded_sequence_hidden(config: ModelConfig, params, tokens, layers: tuple = ()):
  """Full-sequence forward over right-padded rows (-1 = padding), as learners need it.

  Returns (hidden [B, T, D], widened to [B, T, (1 + len(layers)) D] with the outputs of
  decoder `layers` (apply_with_features); tokens with padding as 0; valid mask [B, T]).
  """
  safe, positions, mask, valid = _padded_inputs(tokens)
  hidden, _ = apply_with_features(Transformer(config), params, layers, safe, positions, mask)
  return hidden, safe, valid


def padded_sequence_features(config: ModelConfig, params, tokens, layers: tuple):
  """[B, T, (1 + len(layers)) D]: the final hidden state, then the outputs of decoder
  `layers` (0-based), of a full-sequence forward over right-padded rows (-1 = padding):
  the pairs of a drafter that fuses layer features."""
  return padded_sequence_hidden(config, params, tokens, layers)[0]


def apply_with_features(model: Transformer, params, layers: tuple, *args):
  """model(*args), its hidden states widened with the outputs of decoder `layers` (0-based):
  (features [B, T, (1 + len(layers)) D], the final hidden state first; BlockKV). Captured from
  the same forward, so the final part is bit for bit what the forward alone returns; without
  layers it is that forward."""
  if not layers:
    return model.apply({'params': params}, *args)
  names = {f'layers_{i}' for i in layers}
  (hidden, block), captured = model.apply(
      {'params': params}, *args,
      capture_intermediates=lambda module, method: method == '__call__' and module.name in names,
      mutable=['intermediates'])
  outputs = [captured['intermediates'][f'layers_{i}']['__call__'][0][0] for i in layers]
  return jnp.concatenate([hidden] + [x.astype(hidden.dtype) for x in outputs], axis=-1), block


def final_hidden(config: ModelConfig, features):
  """The final hidden states [..., D] inside features laid out as apply_with_features lays
  them out (their first part; all of them without layers)."""
  return features[..., :config.hidden_size]
