"""The one writer of every results folder: results.json whole, a README with the command,
tables and figures, and the numbers as TensorBoard scalars."""
import json

import numpy as np
import pytest

from experiments.lib.results import Figure, Result, Table, write
from tests.tensorboard_events import read_events


def _result():
  return Result(
      title='A measurement', command='python -m experiments.measure.thing --flag=1',
      data={'speedup': 1.5, 'by_rows': {'4': {'tau': 2.25}}, 'identical': True,
            'cases': [1, 2], 'note': 'text', 'missing': float('nan')},
      body=['Some context.', Table(['rows', 'tau'], [[4, '2.25']], align='lr')],
      figures=[Figure('tau.png', 'tau by rows', lambda fig: fig.subplots().plot([1, 2]))])


def test_write_makes_the_json_the_readme_the_figure_and_the_scalars(tmp_path):
  write(_result(), tmp_path / 'out', tensorboard_dir=tmp_path / 'tb')
  data = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert list(data)[0] == 'command' and data['by_rows'] == {'4': {'tau': 2.25}}
  assert (tmp_path / 'out' / 'README.md').read_text() == (
      '# A measurement\n\nCommand: `python -m experiments.measure.thing --flag=1`\n\n'
      'Some context.\n\n| rows | tau |\n|---|---:|\n| 4 | 2.25 |\n\n'
      '![tau by rows](tau.png)\n')
  assert (tmp_path / 'out' / 'tau.png').read_bytes()[:4] == b'\x89PNG'
  assert not list((tmp_path / 'out').glob('*.tmp'))
  events = [e for f in (tmp_path / 'tb' / 'out').iterdir() for e in read_events(f)]
  tags = {v.tag: v.simple_value for e in events for v in e.summary.value}
  # Finite numbers only, nested keys as paths; lists and strings stay in results.json.
  assert tags == {'speedup': np.float32(1.5), 'by_rows/4/tau': np.float32(2.25),
                  'identical': np.float32(1.0)}


def test_a_table_whose_alignment_misses_a_column_is_an_error():
  with pytest.raises(ValueError, match="align 'l' has 1 letters for 2 columns"):
    Table(['a', 'b'], [[1, 2]], align='l').markdown()
