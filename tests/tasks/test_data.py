"""Dataset loading: the full datasets where they are, their first rows (fixtures) always, plus
malformed and missing inputs."""
import json
import logging

import pytest

from specroll_jax.tasks import data, paths, rewards
from tests.conftest import FIXTURE_DATA, needs_full_data

# (name, split, rows in the data directory's README.md, malformed rows among them)
FULL = [
    ('gsm8k', 'train', 7473, 0),
    ('gsm8k', 'test', 1319, 0),
    ('math', None, 8888, 3),  # Three MATH rows have an empty answer.
    ('dapo', None, 17917, 0),
    ('math500', None, 500, 0),
    ('aime24', None, 30, 0),
    ('amc23', None, 40, 0),
    ('minerva_math', None, 272, 0),
]


# The fixtures: (name, split, rows, malformed rows among them); see tests/fixtures/data.
FIXTURES = [
    ('gsm8k', 'train', 4, 0),
    ('gsm8k', 'test', 4, 0),
    ('math', None, 5, 1),  # Row 4150 of the full file, whose answer is empty.
    ('dapo', None, 4, 0),
    ('math500', None, 3, 0),
    ('aime24', None, 3, 0),
    ('amc23', None, 3, 0),
    ('minerva_math', None, 3, 0),
]


def _check_counts_and_first_row(loaded, name, rows, malformed):
  assert (len(loaded.examples), loaded.skipped) == (rows - malformed, malformed)
  first = loaded.examples[0]
  assert first.source == name and first.index == 0
  assert first.prompt and first.answer
  assert first.kind in rewards.KINDS


@needs_full_data
@pytest.mark.parametrize('name,split,rows,malformed', FULL)
def test_loads_full_dataset(name, split, rows, malformed):
  _check_counts_and_first_row(data.load_dataset(name, split=split), name, rows, malformed)


@pytest.mark.parametrize('name,split,rows,malformed', FIXTURES)
def test_loads_fixture_rows(name, split, rows, malformed):
  _check_counts_and_first_row(data.load_dataset(name, FIXTURE_DATA, split=split), name, rows,
                              malformed)


@pytest.fixture(params=['fixtures', pytest.param('full', marks=needs_full_data)])
def data_dir(request):
  """The fixture rows, and the full datasets where they are: their first rows are the same."""
  return FIXTURE_DATA if request.param == 'fixtures' else None


def test_gold_answers_and_prompts(data_dir):
  gsm = data.load_dataset('gsm8k', data_dir, split='test').examples[0]
  assert gsm.answer == '18' and gsm.kind == 'gsm8k'
  assert gsm.prompt.startswith('Question:\nJanet') and '####' in gsm.prompt
  math = data.load_dataset('math500', data_dir).examples[0]
  assert math.answer == '\\left( 3, \\frac{\\pi}{2} \\right)'
  assert math.prompt.startswith('Question:\nConvert the point $(0,3)$ in rectangular')
  assert math.prompt.endswith("$(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$"
                              "\nAnswer:\nLet's think step by step.\n")
  assert data.load_dataset('amc23', data_dir).examples[0].answer == '27'  # Stored as 27.0.
  assert data.load_dataset('minerva_math', data_dir).examples[0].answer == '1.6'  # From \boxed.
  assert '\\boxed{}' in data.load_dataset('dapo', data_dir).examples[0].prompt


@pytest.mark.parametrize('name', data.DATASETS)
def test_gold_answers_grade_themselves_correct(name, data_dir):
  for example in data.load_dataset(name, data_dir).examples[:20]:
    completion = f'#### {example.answer}' if example.kind == 'gsm8k' else \
        f'\\boxed{{{example.answer}}}'
    assert rewards.score(completion, example.answer, example.kind) == 1.0, example


def test_custom_template():
  loaded = data.load_dataset('aime24', FIXTURE_DATA, template='Q: {input} \\boxed{}')
  assert loaded.examples[0].prompt.startswith('Q: Every morning Aya')
  with pytest.raises(ValueError, match='input'):
    data.load_dataset('aime24', FIXTURE_DATA, template='no placeholder')


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
  with pytest.raises(FileNotFoundError, match='nowhere.*chosen by the data_dir given'):
    data.load_dataset('math500', data_dir=tmp_path / 'nowhere')


def test_data_dir_comes_from_the_environment_before_the_default(tmp_path, monkeypatch):
  monkeypatch.setenv(paths.DATA_DIR_VARIABLE, str(FIXTURE_DATA))
  assert data.load_dataset('amc23').examples[0].answer == '27'
  assert paths.data_dir(tmp_path) == tmp_path.resolve()  # An explicit path comes first.
  monkeypatch.setenv(paths.DATA_DIR_VARIABLE, str(tmp_path / 'absent'))
  with pytest.raises(FileNotFoundError) as error:
    data.load_dataset('gsm8k')
  message = str(error.value)
  assert f'chosen by ${paths.DATA_DIR_VARIABLE}' in message and 'absent' in message
  assert 'gsm8k/train.jsonl' in message and 'eval/math500.test.jsonl' in message
  monkeypatch.delenv(paths.DATA_DIR_VARIABLE)
  assert paths.data_dir_exists() == paths.DEFAULT_DATA_DIR.is_dir()


def test_missing_file_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match='aime24.test.jsonl'):
    data.load_dataset('aime24', data_dir=tmp_path)


def test_file_without_valid_rows_is_named(tmp_path):
  _write(tmp_path / 'dapo' / 'dapo_math_17k.jsonl', ['{"problem": "x", "answer": ""}'])
  with pytest.raises(ValueError, match='dapo_math_17k.jsonl'):
    data.load_dataset('dapo', data_dir=tmp_path)


def test_unknown_dataset_and_split():
  with pytest.raises(ValueError, match="unknown dataset 'mmlu'"):
    data.load_dataset('mmlu', FIXTURE_DATA)
  with pytest.raises(ValueError, match="no split 'validation'"):
    data.load_dataset('gsm8k', FIXTURE_DATA, split='validation')
