"""LoRA adapters for the policy: W' = W + (alpha / r) A B on the targeted kernels.

Adapters are their own pytree, shaped like the parameters they adapt (path/lora_a [in, r],
path/lora_b [r, out]), in float32 whatever the policy's dtype. B starts at zero, so a fresh
adapter leaves every weight bit for bit as it was. The learner differentiates through
`merge` (only adapters get gradients and optimizer state); rollouts run on the merged
weights, computed once per GRPO step, so the engines never see an adapter.
"""
import jax
import jax.numpy as jnp
from flax import traverse_util

DEFAULT_TARGETS = 'q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj'


def target_names(targets: str) -> tuple[str, ...]:
  return tuple(name.strip() for name in targets.split(',') if name.strip())


def targeted_kernels(params, targets: str) -> dict:
  """{'.../q_proj/kernel': kernel, ...}: the flattened kernels whose module is in `targets`."""
  names = target_names(targets)
  flat = traverse_util.flatten_dict(params, sep='/')
  return {path: value for path, value in flat.items()
          if path.endswith('/kernel') and path.split('/')[-2] in names}


def init_adapters(params, rank: int, targets: str, seed: int) -> dict:
  """A ~ N(0, 1/in), B = 0 for every kernel whose module name is in `targets`."""
  kernels = targeted_kernels(params, targets)
  if not kernels:
    raise ValueError(f'config grpo.lora_targets={targets!r} matches no kernel of the policy '
                     '(module names such as q_proj, down_proj)')
  keys = jax.random.split(jax.random.key(seed), len(kernels))
  flat = {}
  for key, (kernel_path, kernel) in zip(keys, sorted(kernels.items())):
    path = kernel_path[:-len('/kernel')]
    fan_in, fan_out = kernel.shape
    flat[f'{path}/lora_a'] = jax.random.normal(key, (fan_in, rank), jnp.float32) * fan_in ** -0.5
    flat[f'{path}/lora_b'] = jnp.zeros((rank, fan_out), jnp.float32)
  return traverse_util.unflatten_dict(flat, sep='/')


def merge(params, adapters, scale: float):
  """The policy's parameters with every adapted kernel replaced by W + scale A B."""
  flat = traverse_util.flatten_dict(params, sep='/')
  pairs = traverse_util.flatten_dict(adapters, sep='/')
  merged = dict(flat)
  for path in {p.rsplit('/', 1)[0] for p in pairs}:
    kernel = flat[f'{path}/kernel']
    delta = scale * (pairs[f'{path}/lora_a'] @ pairs[f'{path}/lora_b'])
    merged[f'{path}/kernel'] = kernel + delta.astype(kernel.dtype)
  return traverse_util.unflatten_dict(merged, sep='/')


merge_jit = jax.jit(merge, static_argnums=2)
