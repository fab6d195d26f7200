"""The W1 task generator and a tiny pretraining run end to end."""
import dataclasses
import json
import re

import numpy as np
import pytest

from specroll_jax import load_policy
from specroll_jax.tasks import rewards
from specroll_jax.tasks.default_policy import (COMMITTED_POLICY, DIRECTORY_PREFIX, build_key,
                                               ensure_default_policy)
from specroll_jax.tasks.pretrain import (DEFAULT_TOKENIZER_DIR, PretrainConfig, REPORT_FILE,
                                         file_sha256, pretrain)
from specroll_jax.tasks.synthetic_math import make_problems

_LINE = re.compile(r'(\d+) ([-+*/]) (\d+) = (\d+)')
_APPLY = {'+': lambda a, b: a + b, '-': lambda a, b: a - b, '*': lambda a, b: a * b,
          '/': lambda a, b: a / b}

TINY = PretrainConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, train_problems=2000, batch_rows=4,
                      learning_rate=1e-2, warmup_steps=5, max_steps=30, eval_problems=2,
                      max_new_tokens=16)


def _steps(problem):
  return [_LINE.fullmatch(line) for line in problem.solution.splitlines()[:-1]]


def test_same_seed_same_problems_other_seed_others():
  assert make_problems('hard', 50, seed=3) == make_problems('hard', 50, seed=3)
  assert make_problems('hard', 50, seed=3) != make_problems('hard', 50, seed=4)
  assert make_problems('easy', 50, seed=3) != make_problems('hard', 50, seed=3)


@pytest.mark.parametrize('split', ['easy', 'hard'])
def test_solutions_compute_correctly_and_score(split):
  for problem in make_problems(split, 500, seed=0):
    steps = _steps(problem)
    assert steps and all(steps), problem.solution
    value = None
    for match in steps:
      a, op, b, c = match.groups()
      assert value is None or int(a) == value, problem.solution  # each line uses the last
      assert _APPLY[op](int(a), int(b)) == int(c) > 0, problem.solution
      value = int(c)
    assert problem.solution.splitlines()[-1] == f'#### {value}' and problem.answer == str(value)
    assert rewards.score(problem.solution, problem.answer, 'gsm8k') == 1.0
    assert rewards.score(problem.solution, str(value + 1), 'gsm8k') == 0.0


def test_hard_split_is_harder():
  easy, hard = (make_problems(split, 500, seed=0) for split in ('easy', 'hard'))
  steps = {name: np.mean([len(_steps(p)) for p in problems])
           for name, problems in (('easy', easy), ('hard', hard))}
  assert steps['easy'] < 2.0 < 3.0 <= steps['hard']
  largest = lambda problems: np.mean([max(int(n) for n in re.findall(r'\d+', p.solution))
                                      for p in problems])
  assert largest(easy) < largest(hard)


def test_unknown_split_is_named():
  with pytest.raises(ValueError, match="'medium'"):
    make_problems('medium', 1, seed=0)


def test_tiny_pretraining_learns_and_saves_a_loadable_policy(tmp_path):
  out = ensure_default_policy(tmp_path, config=TINY)
  assert out.parent == tmp_path and out.name.startswith(DIRECTORY_PREFIX)
  report = json.loads((out / REPORT_FILE).read_text())
  assert report['steps'] == TINY.max_steps
  assert report['final_loss'] < 0.8 * report['first_loss']
  assert 0.0 <= report['accuracy_easy'] <= 1.0 and 0.0 <= report['accuracy_hard'] <= 1.0
  policy = load_policy(out)
  assert policy.config.eos_token_id == 2 and len(policy.tokenizer) == 512
  # Cached: a second call returns the directory without training; pretrain refuses to
  # overwrite unless told to.
  assert ensure_default_policy(tmp_path, config=TINY) == out
  assert json.loads((out / REPORT_FILE).read_text()) == report
  with pytest.raises(FileExistsError, match='already holds a policy'):
    pretrain(TINY, out)
  # The same config builds the same weights, bit for bit (training is defined by steps,
  # not by time); another config gets a directory of its own.
  again = pretrain(TINY, tmp_path / 'again')
  assert again['model_sha256'] == report['model_sha256'] == file_sha256(out / 'model.safetensors')
  other = dataclasses.replace(TINY, seed=1)
  assert build_key(other, DEFAULT_TOKENIZER_DIR) != build_key(TINY, DEFAULT_TOKENIZER_DIR)


def test_the_default_config_is_the_committed_policy_unbuilt(tmp_path):
  assert ensure_default_policy(tmp_path) == COMMITTED_POLICY
  assert not any(tmp_path.iterdir())
  report = json.loads((COMMITTED_POLICY / REPORT_FILE).read_text())
  assert report['config'] == dataclasses.asdict(PretrainConfig())
  assert file_sha256(COMMITTED_POLICY / 'model.safetensors') == report['model_sha256']
  assert report['accuracy_hard'] >= 0.2  # rewards carry signal from the first GRPO step
  assert load_policy(COMMITTED_POLICY).config.num_layers == PretrainConfig().num_layers
