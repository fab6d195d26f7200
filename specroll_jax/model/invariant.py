"""Batch-invariant numerics for the bfloat16 compute mode (`ModelConfig.compute_dtype`).

A row's result must not depend on the other rows, on how many there are, or on which
program computed it (a one-token step, a tree, prefill, the learner's full sequence), so
that the speculative engine equals vanilla and the rollout equals the learner bit for bit.
Each primitive here has one fixed order of floating-point operations per row. What this
backend (XLA:CPU, jax 0.10.2, AMX-BF16) was measured to do, and what each rule answers:

- bf16-input, float32-accumulate dots give every row bitwise the same result for any number
  of rows >= 3 (1 and 2 rows take other kernels: rows are padded to 3), any number of
  columns and any batch dimensions, when the contraction is a multiple of 32 terms
  (measured K = 32, 64, 96, 160, 192, 256, 320, 576, 1536: invariant; 8, 16, 48, 172, 176,
  200: a row's bits change from 4-8 rows on). So every contraction is zero-padded to a
  multiple of 32 (SmolLM2's 64, 576 and 1536 need none). A contraction's result does change
  with its padded length, so the length is fixed per weight. Attention's contractions are
  not dots at all (invariant_attention.py says why): `pairwise_dot`.
- XLA's reduce changes its order with the number of rows: sums are `pairwise_sum`, a fixed
  tree of elementwise adds over a power-of-two length. Zero padding leaves it unchanged
  (x + 0 = x at every level whose upper half is zeros), so a sum over a longer buffer whose
  extra entries are zeros gives the same bits: what lets a cache window, a tree or the
  learner's row hold a position at different indices of different lengths.
- XLA:CPU contracts a multiply feeding an add into one fused multiply-add inside a fusion,
  and which ops share a fusion depends on the whole program (a learner's full-sequence
  forward, measured, left one add unfused that a decode step fused: its hidden states
  differed from the 14th position on). So no rounded product feeds an add here: every
  product that is summed is exact in float32 (bf16 x bf16, 16 significant bits), and then
  fma(a, b, c) = round(round(a * b) + c). The dots take bf16 inputs; RoPE rounds its
  operands to bf16 (as transformers does in bf16); RMSNorm squares x = hi + lo in bf16
  parts (x^2 to 2^-16); the softmax scale is applied to q before the scores; XLA
  rewrites a division by a constant as a product, so none feeds an add either.
- Denormals are flushed on some threads and not on others: exponents below `EXP_FLOOR`
  become exactly 0.
- 1 / sqrt instead of rsqrt, whose bits vary with the shape here.
Checked on the engines by `tests/model/test_bf16_compute.py`.
"""
from functools import partial

import jax
import jax.numpy as jnp

BF16 = jnp.bfloat16
MIN_MATMUL_ROWS = 3
CONTRACTION_QUANTUM = 32
EXP_FLOOR = -80.0


def pairwise_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Sum along `axis` by a fixed pairwise tree (first half + second half), zero-padded to a
  power of two: the same bits for any trailing zero padding of the axis, and for any
  position of the axis (summing a leading axis adds whole planes, which vectorizes)."""
  axis = axis % x.ndim
  length = x.shape[axis]
  x = pad_axis(x, axis, 1 << max(0, (length - 1).bit_length()))
  while x.shape[axis] > 1:
    half = x.shape[axis] // 2
    x = (jax.lax.slice_in_dim(x, 0, half, axis=axis)
         + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
  return jax.lax.squeeze(x, (axis,))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def pairwise_dot(a: jax.Array, b: jax.Array, axis: int) -> jax.Array:
  """pairwise_sum(a * b, axis), bit for bit, for bf16-representable a and b (exact products;
  a and b broadcast against each other), written as one expression over the axis' slices,
  so that XLA fuses the whole tree into one loop and never materialises the products or a
  level of the tree (a product tensor and its levels were most of the attention's time).
  Its gradient is a plain broadcast-multiply-sum: only the forward values must not move."""
  axis = axis % a.ndim
  length = 1 << max(0, (a.shape[axis] - 1).bit_length())
  a, b = pad_axis(a, axis, length), pad_axis(b, axis, length)
  term = lambda i: (jax.lax.index_in_dim(a, i, axis, keepdims=False)
                    * jax.lax.index_in_dim(b, i, axis, keepdims=False))
  terms = [term(i) for i in range(length)]
  while len(terms) > 1:
    half = len(terms) // 2
    terms = [terms[i] + terms[i + half] for i in range(half)]
  return terms[0]


def _pairwise_dot_forward(a, b, axis):
  return pairwise_dot(a, b, axis), (a, b)


def _pairwise_dot_backward(axis, residuals, grad):
  a, b = residuals
  grad = jnp.expand_dims(grad, axis % a.ndim)

  def reduced_to(x, other):
    summed = tuple(i for i, (n, m) in enumerate(zip(x.shape, other.shape)) if n == 1 and m > 1)
    return jnp.sum(grad * other, axis=summed, keepdims=True).astype(x.dtype)

  return reduced_to(a, b), reduced_to(b, a)


pairwise_dot.defvjp(_pairwise_dot_forward, _pairwise_dot_backward)


def log_softmax(x: jax.Array) -> jax.Array:
  """log softmax over the last axis with a fixed summation order: the rollout's log-probs
  and the learner's are this one function of the same logits."""
  peak = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  shifted = x - peak
  return shifted - jnp.log(pairwise_sum(jnp.exp(shifted)))[..., None]


def logsumexp(x: jax.Array) -> jax.Array:
  """log sum exp over the last axis in the same fixed order (-inf for an all -inf row)."""
  peak = jax.lax.stop_gradient(jnp.max(x, axis=-1))
  safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
  return safe + jnp.log(pairwise_sum(jnp.exp(x - safe[..., None])))


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  missing = size - x.shape[axis]
  if missing <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, missing)
  return jnp.pad(x, widths)


def _rows_dot(x: jax.Array, weight: jax.Array, contract: int) -> jax.Array:
  """x [M, K] against `weight` contracted on its axis `contract` -> float32 [M, N]: bf16
  inputs, float32 accumulation, rows padded to 3 and the contraction zero-padded to a
  multiple of CONTRACTION_QUANTUM (the same length for every call on this weight)."""
  rows = x.shape[0]
  length = ceil_div(x.shape[1], CONTRACTION_QUANTUM) * CONTRACTION_QUANTUM
  x = pad_axis(pad_axis(x.astype(BF16), 1, length), 0, MIN_MATMUL_ROWS)
  weight = pad_axis(weight.astype(BF16), contract, length)
  return _bf16_dot(x, weight, contract)[:rows]


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16_dot(x: jax.Array, weight: jax.Array, contract: int) -> jax.Array:
  """bf16 x [M, K] against bf16 `weight` contracted on its axis `contract` -> float32."""
  return jax.lax.dot_general(x, weight, (((1,), (contract,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _bf16_dot_forward(x, weight, contract):
  return _bf16_dot(x, weight, contract), (x, weight)


def _bf16_dot_backward(contract, residuals, grad):
  """The gradients' matmuls in bf16 too, float32-accumulated: JAX's own rule would contract
  the float32 cotangent with the weight upcast to float32, the slow path on every matrix
  unit (two thirds of the learner's matmul work). The cotangent is rounded to bf16 (2^-8
  relative per element); both gradients are rounded to bf16 by either rule, since the
  operands are bf16."""
  x, weight = residuals
  grad = grad.astype(BF16)
  grad_x = jax.lax.dot_general(grad, weight, (((1,), (1 - contract,)), ((), ())),
                               preferred_element_type=jnp.float32)
  # weight [K, N] (contract 0) gets x^T grad; a [N, K] table (contract 1) gets grad^T x.
  pair = (x, grad) if contract == 0 else (grad, x)
  grad_weight = jax.lax.dot_general(*pair, (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
  return grad_x.astype(BF16), grad_weight.astype(BF16)


_bf16_dot.defvjp(_bf16_dot_forward, _bf16_dot_backward)


def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., K] @ kernel [K, N] -> float32 [..., N], row-invariant."""
  out = _rows_dot(x.reshape(-1, x.shape[-1]), kernel, 0)
  return out.reshape(x.shape[:-1] + (kernel.shape[-1],))


def table_matmul(x: jax.Array, table: jax.Array) -> jax.Array:
  """x [..., D] against a [V, D] table (logit v = table[v] . x) -> float32 [..., V],
  contracting the table as stored: a transposed bf16 table costs ~10x here."""
  out = _rows_dot(x.reshape(-1, x.shape[-1]), table, 1)
  return out.reshape(x.shape[:-1] + (table.shape[0],))


def _bf16_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x ~ hi + lo, both bf16-representable (float32 arrays), to 2^-17 of x."""
  hi = x.astype(BF16).astype(jnp.float32)
  return hi, (x - hi).astype(BF16).astype(jnp.float32)


def exact_square_sum(x: jax.Array) -> jax.Array:
  """sum x^2 over the last axis from exact products: hi^2 + lo (2 hi + lo)."""
  hi, lo = _bf16_parts(x)
  return pairwise_sum(hi * hi) + pairwise_sum(lo * (hi + hi + lo).astype(BF16).astype(jnp.float32))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  # (sum + eps D) / D, not sum / D + eps: XLA turns / D into * (1 / D), which would feed
  # the add and be contracted or not with the fusion.
  width = x.shape[-1]
  mean_square = (exact_square_sum(x) + eps * width) / width
  return x / jnp.sqrt(mean_square)[..., None] * weight.astype(BF16).astype(jnp.float32)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """The rotary embedding ('rotate_half' layout) from bf16 operands, so both products of
  each output are exact and their sum is one rounding wherever XLA fuses it."""
  to_bf16 = lambda a: a.astype(BF16).astype(jnp.float32)
  x, cos, sin = to_bf16(x), to_bf16(cos), to_bf16(sin)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def attention_weights(scores: jax.Array, peak: jax.Array, visible: jax.Array) -> jax.Array:
  """exp(scores - peak) where visible and above the floor, else exactly 0; rounded to bf16
  (the value both the numerator's products and the denominator read)."""
  z = scores - peak
  weights = jnp.where(visible & (z > EXP_FLOOR), jnp.exp(jnp.maximum(z, EXP_FLOOR)), 0.0)
  return weights.astype(BF16).astype(jnp.float32)


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)
