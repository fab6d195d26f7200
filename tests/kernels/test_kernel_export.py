"""The tree-attention kernel lowers for the accelerators it is written for, from this CPU.

Nothing here runs the kernel (test_tree_attention checks its results in interpret mode);
exporting it for cuda and tpu makes their lowerings fail here, not on a GPU or TPU host,
when the kernel or JAX changes. The shape is one of test_tree_attention's: query rows
and block keys padded to powers of two, 16-slot cache tiles.
"""
import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from kernels.tree_attention import tree_attention

BATCH, SLOTS, BLOCK, HEADS, KV_HEADS, HEAD_DIM, BLOCK_S = 3, 40, 5, 4, 2, 32, 16
# What each platform's module must call: the lowering the kernel chose for it.
KERNEL_CALLS = {'cuda': '__gpu$xla.gpu.triton', 'tpu': 'tpu_custom_call'}


def _argument_shapes():
  f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)
  return (f32(BATCH, BLOCK, HEADS, HEAD_DIM),
          f32(BATCH, KV_HEADS, SLOTS, HEAD_DIM),
          f32(BATCH, KV_HEADS, SLOTS, HEAD_DIM),
          jax.ShapeDtypeStruct((BATCH,), jnp.int32),
          f32(BATCH, BLOCK, KV_HEADS, HEAD_DIM),
          f32(BATCH, BLOCK, KV_HEADS, HEAD_DIM),
          jax.ShapeDtypeStruct((BATCH, BLOCK, BLOCK), jnp.bool_))


def _export(platform):
  kernel = jax.jit(lambda *args: tree_attention(*args, scale=HEAD_DIM ** -0.5,
                                                block_s=BLOCK_S))
  # A kernel's custom call has no serialization compatibility guarantee; the lowering is
  # what is under test, not a stored artifact.
  unchecked = [export.DisabledSafetyCheck.custom_call(KERNEL_CALLS[platform])]
  return export.export(kernel, platforms=[platform], disabled_checks=unchecked)(
      *_argument_shapes())


def _assert_compiled_for(platform, module):
  calls = {p: call in module for p, call in KERNEL_CALLS.items()}
  assert calls == {p: p == platform for p in KERNEL_CALLS}
  # The interpreter's lowering is a while loop over the grid: it must not be what ships.
  assert 'stablehlo.while' not in module


def test_exports_for_cuda_through_triton():
  _assert_compiled_for('cuda', _export('cuda').mlir_module())


def test_exports_for_tpu_through_mosaic():
  # Mosaic sizes its layouts from the chip: name one, as a TPU host's devices would.
  chip = AbstractDevice(device_kind='TPU v5 lite', num_cores=1, platform='tpu')
  with use_abstract_mesh(AbstractMesh((1,), ('rows',), abstract_device=chip)):
    module = _export('tpu').mlir_module()
  _assert_compiled_for('tpu', module)

