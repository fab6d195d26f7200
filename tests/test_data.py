"""Dataset loading: real shared files, plus malformed and missing inputs."""
import json
import logging

import pytest

from specroll_jax.tasks import data, rewards

# (name, split, rows in /work/shared/data/README.md, malformed rows among them)
SHARED = [
    ('gsm8k', 'train', 7473, 0),
    ('gsm8k', 'test', 1319, 0),
    ('math', None, 8888, 3),  # Three MATH rows have an empty answer.
    ('dapo', None, 17917, 0),
    ('math500', None, 500, 0),
    ('aime24', None, 30, 0),
    ('amc23', None, 40, 0),
    ('minerva_math', None, 272, 0),
]


@pytest.mark.parametrize('name,split,rows,malformed', SHARED)
def test_loads_shared_dataset(name, split, rows, malformed):
  loaded = data.load_dataset(name, split=split)
  assert (len(loaded.examples), loaded.skipped) == (rows - malformed, malformed)
  first = loaded.examples[0]
  assert first.source == name and first.index == 0
  assert first.prompt and first.answer
  assert first.kind in rewards.KINDS


def test_gold_answers_and_prompts():
  gsm = data.load_dataset('gsm8k', split='test').examples[0]
  assert gsm.answer == '18' and gsm.kind == 'gsm8k'
  assert gsm.prompt.startswith('Question:\nJanet') and '####' in gsm.prompt
  math = data.load_dataset('math500').examples[0]
  assert math.answer == '\\left( 3, \\frac{\\pi}{2} \\right)'
  assert math.prompt.startswith('Question:\nConvert the point $(0,3)$ in rectangular')
  assert math.prompt.endswith("$(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$"
                              "\nAnswer:\nLet's think step by step.\n")
  assert data.load_dataset('amc23').examples[0].answer == '27'  # Stored as 27.0.
  assert data.load_dataset('minerva_math').examples[0].answer == '1.6'  # From \boxed.
  assert '\\boxed{}' in data.load_dataset('dapo').examples[0].prompt


@pytest.mark.parametrize('name', data.DATASETS)
def test_gold_answers_grade_themselves_correct(name):
  for example in data.load_dataset(name).examples[:20]:
    completion = f'#### {example.answer}' if example.kind == 'gsm8k' else \
        f'\\boxed{{{example.answer}}}'
    assert rewards.score(completion, example.answer, example.kind) == 1.0, example


def test_custom_template():
  loaded = data.load_dataset('aime24', template='Q: {input} \\boxed{}')
  assert loaded.examples[0].prompt.startswith('Q: Every morning Aya')
  with pytest.raises(ValueError, match='input'):
    data.load_dataset('aime24', template='no placeholder')


def _write(path, lines):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text('\n'.join(lines) + '\n', encoding='utf-8')


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
  good = json.dumps({'question': 'What is 2+2?', 'answer': 'It is 4.\n#### 4'})
  _write(tmp_path / 'gsm8k' / 'train.jsonl', [
      good,
      '{"question": "truncated',  # Bad JSON: line 2.
      json.dumps({'question': 'No answer field'}),
      json.dumps({'question': '', 'answer': '#### 1'}),
      json.dumps({'question': 'No #### marker', 'answer': '5'}),
      json.dumps(['not', 'an', 'object']),
      '',
      good,
  ])
  with caplog.at_level(logging.WARNING):
    loaded = data.load_dataset('gsm8k', data_dir=tmp_path)
  assert loaded.skipped == 5
  assert [e.index for e in loaded.examples] == [0, 7]
  assert loaded.examples[0].answer == '4'
  assert 'skipped 5 malformed rows (first at line 2)' in caplog.text


def test_missing_data_dir_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='nowhere'):
    data.load_dataset('math500', data_dir=tmp_path / 'nowhere')


def test_missing_file_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='aime24.test.jsonl'):
    data.load_dataset('aime24', data_dir=tmp_path)


def test_file_without_valid_rows_is_named(tmp_path):
  _write(tmp_path / 'dapo' / 'dapo_math_17k.jsonl', ['{"problem": "x", "answer": ""}'])
  with pytest.raises(ValueError, match='dapo_math_17k.jsonl'):
    data.load_dataset('dapo', data_dir=tmp_path)


def test_unknown_dataset_and_split():
  with pytest.raises(ValueError, match="unknown dataset 'mmlu'"):
    data.load_dataset('mmlu')
  with pytest.raises(ValueError, match="no split 'validation'"):
    data.load_dataset('gsm8k', split='validation')
