"""Statistics of vocabulary logits computed a chunk of rows at a time.

Head training needs, at every (sequence, position, head), a full-vocabulary normaliser, yet
only a few numbers per row survive (log-probs at the policy's top-K, a top-k). Projecting all
rows at once materialises [rows, V] float32 logits: for SmolLM2 (V = 49,152), 16 sequences x
280 positions x 4 heads are 3.5 GB, and their softmax and gradient as much again (the warm
start was killed at 24 GB). Here the rows go through `lax.map` in chunks of at most
`MAX_CHUNK_LOGITS` logits, and each chunk is rematerialised in the backward pass, so one
chunk's logits are live at a time and gradients are exact.
"""
import jax
import jax.numpy as jnp

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.transformer import Transformer

# float32 logits per chunk: 32 MB, 170 rows of SmolLM2, 16k rows of stories260K.
MAX_CHUNK_LOGITS = 1 << 23


def rows_per_chunk(vocab_size: int, rows: int) -> int:
  return max(1, min(rows, MAX_CHUNK_LOGITS // vocab_size))


def map_projected(model_config: ModelConfig, policy_params, hidden, fn, *row_inputs):
  """fn(logits [c, V], *row_inputs chunks) over row chunks of hidden [R, D]; outputs [R, ...].

  `row_inputs` are arrays with R leading rows that travel with their hidden states.
  """
  rows = hidden.shape[0]
  chunk = rows_per_chunk(model_config.vocab_size, rows)
  padded = -(-rows // chunk) * chunk

  def split(x):
    x = jnp.pad(x, [(0, padded - rows)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((padded // chunk, chunk) + x.shape[1:])

  @jax.checkpoint
  def one_chunk(inputs):
    logits = Transformer(model_config).apply({'params': policy_params}, inputs[0],
                                             method=Transformer.project)
    return fn(logits, *inputs[1:])

  out = jax.lax.map(one_chunk, tuple(split(x) for x in (hidden,) + row_inputs))
  return jax.tree.map(lambda y: y.reshape((padded,) + y.shape[2:])[:rows], out)
