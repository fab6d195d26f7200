"""Hugging Face directories <-> (ModelConfig, Flax params), offline, via safetensors."""
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from specroll_jax.model.config import ModelConfig

# Tensors some exporters write that carry no parameters of ours: a tied head's copy and
# precomputed rotary tables.
_IGNORED_TENSOR = re.compile(r'lm_head\.weight|.*rotary_emb\.inv_freq')

_LINEAR = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj',
           'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj')


def tensor_layout(config: ModelConfig) -> dict:
  """HF tensor name -> (Flax param path, HF shape, whether HF stores it transposed)."""
  c = config
  q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  out_in = {'self_attn.q_proj': (q_out, c.hidden_size), 'self_attn.k_proj': (kv_out, c.hidden_size),
            'self_attn.v_proj': (kv_out, c.hidden_size), 'self_attn.o_proj': (c.hidden_size, q_out),
            'mlp.gate_proj': (c.intermediate_size, c.hidden_size),
            'mlp.up_proj': (c.intermediate_size, c.hidden_size),
            'mlp.down_proj': (c.hidden_size, c.intermediate_size)}
  layout = {'model.embed_tokens.weight': (('embed_tokens', 'embedding'),
                                          (c.vocab_size, c.hidden_size), False),
            'model.norm.weight': (('norm', 'weight'), (c.hidden_size,), False)}
  if not c.tie_word_embeddings:
    layout['lm_head.weight'] = (('lm_head', 'kernel'), (c.vocab_size, c.hidden_size), True)
  for i in range(c.num_layers):
    prefix, layer = f'model.layers.{i}.', f'layers_{i}'
    for norm in ('input_layernorm', 'post_attention_layernorm'):
      layout[prefix + norm + '.weight'] = ((layer, norm, 'weight'), (c.hidden_size,), False)
    for name in _LINEAR:
      module, proj = name.split('.')
      layout[prefix + name + '.weight'] = ((layer, module, proj, 'kernel'), out_in[name], True)
      has_bias = c.o_bias if proj == 'o_proj' else c.qkv_bias and module == 'self_attn'
      if has_bias:
        layout[prefix + name + '.bias'] = ((layer, module, proj, 'bias'), out_in[name][:1], False)
  return layout


def _safetensors_files(directory: Path) -> list[Path]:
  index = directory / 'model.safetensors.index.json'
  if index.is_file():
    names = sorted(set(json.loads(index.read_text())['weight_map'].values()))
    files = [directory / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
      raise FileNotFoundError(f'{index}: lists shard files that do not exist: {missing}')
    return files
  files = sorted(directory.glob('*.safetensors'))
  if not files:
    raise FileNotFoundError(f'{directory}: no *.safetensors weight files found')
  return files


def save_record_and_tensors(directory, record_file: str, record: dict, tensors_file: str,
                            tree) -> None:
  """A JSON record and a pytree of tensors ('/'-joined names) into `directory`, each by
  rename, the tensors last: present tensors mean a complete save (heads, drafters)."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  record_tmp = directory / (record_file + '.tmp')
  record_tmp.write_text(json.dumps(record, indent=2) + '\n')
  record_tmp.replace(directory / record_file)
  tensors_tmp = directory / (tensors_file + '.tmp')
  save_file({'/'.join(k): v for k, v in traverse_util.flatten_dict(tree).items()},
            str(tensors_tmp))
  tensors_tmp.replace(directory / tensors_file)


def unflatten_tensors(tensors: dict, expected, file: Path, model_config: ModelConfig) -> dict:
  """'/'-joined tensors -> a pytree, checked leaf by leaf against `expected` (shapes, e.g.
  from jax.eval_shape of the initialiser); a missing or misshapen tensor names the file."""
  tree = traverse_util.unflatten_dict({tuple(k.split('/')): v for k, v in tensors.items()})
  flat = traverse_util.flatten_dict(tree)
  for name, want in traverse_util.flatten_dict(expected).items():
    got = flat.get(name)
    if got is None or got.shape != want.shape:
      shape = None if got is None else tuple(got.shape)
      raise ValueError(f'{file}: tensor {"/".join(name)!r} has shape {shape}, this policy '
                       f'(hidden_size={model_config.hidden_size}) needs {want.shape}')
  return tree


def unreadable(file: Path, error: Exception) -> ValueError:
  """The error for a weights file that safetensors cannot parse (an interrupted copy, a
  truncated download), naming the file."""
  return ValueError(f'{file}: not a readable safetensors file, truncated or corrupt ({error})')


def load_params(directory: Path, config: ModelConfig) -> dict:
  """Reads every weight the config needs, checking names and shapes, cast to config dtype."""
  layout = tensor_layout(config)
  flat = {}
  for file in _safetensors_files(directory):
    try:
      with safe_open(str(file), framework='numpy') as f:
        for name in f.keys():
          if name not in layout:
            if _IGNORED_TENSOR.fullmatch(name):
              continue
            raise ValueError(f'{file}: unexpected tensor {name!r} (not part of a '
                             f'{config.architecture} with this config.json)')
          path, shape, transposed = layout[name]
          tensor = f.get_tensor(name)
          if tuple(tensor.shape) != shape:
            raise ValueError(f'{file}: tensor {name!r} has shape {tuple(tensor.shape)}, '
                             f'config.json implies {shape}')
          tensor = np.asarray(tensor, dtype=np.float32)
          flat[path] = jnp.asarray(tensor.T if transposed else tensor, dtype=config.jnp_dtype)
    except SafetensorError as e:
      raise unreadable(file, e) from None
  missing = [name for name, (path, _, _) in layout.items() if path not in flat]
  if missing:
    shown = ', '.join(missing[:5]) + (' ...' if len(missing) > 5 else '')
    raise ValueError(f'{directory}: {len(missing)} tensor(s) missing from the safetensors '
                     f'files: {shown}')
  return traverse_util.unflatten_dict(flat)


def save_params(directory: Path, config: ModelConfig, params: dict) -> None:
  """Writes config.json and model.safetensors in HF layout (loadable by transformers)."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  flat = traverse_util.flatten_dict(params)
  tensors = {}
  for name, (path, _, transposed) in tensor_layout(config).items():
    value = flat[path]
    tensors[name] = jnp.asarray(value.T if transposed else value)
  # Write to a temporary name first so an interrupted save never leaves a torn checkpoint.
  tmp = directory / 'model.safetensors.tmp'
  save_file(tensors, str(tmp), metadata={'format': 'pt'})
  tmp.replace(directory / 'model.safetensors')
  (directory / 'config.json').write_text(json.dumps(config.to_hf_dict(), indent=2) + '\n')
