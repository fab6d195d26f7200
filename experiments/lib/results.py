"""One writer for every benchmark's and measurement's results folder.

A script measures and returns a `Result`; `write` makes all of its files: results.json
(written whole or not at all), README.md (title, the exact command, then the script's text
and tables in order, then its figures), the figures as PNG, and every finite number of
results.json (lists stay in the file) as a TensorBoard scalar under
`tensorboard_dir/<folder name>` (outside the committed results: event files are binary and
per run).
"""
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
from tensorboardX import SummaryWriter

from specroll_jax.rl.metrics import scalars

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_TENSORBOARD_DIR = Path('workdir/tensorboard')


@dataclasses.dataclass(frozen=True)
class Table:
  """A markdown table of preformatted cells; `align` has one letter per column, 'l' or
  'r' (the default for every column)."""
  header: Sequence[str]
  rows: Sequence[Sequence]
  align: str = ''

  def markdown(self) -> str:
    align = self.align or 'r' * len(self.header)
    if len(align) != len(self.header):
      raise ValueError(f'Table align {align!r} has {len(align)} letters for '
                       f'{len(self.header)} columns')
    rule = ['---' if a == 'l' else '---:' for a in align]
    lines = ['| ' + ' | '.join(self.header) + ' |', '|' + '|'.join(rule) + '|']
    lines += ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in self.rows]
    return '\n'.join(lines)


@dataclasses.dataclass(frozen=True)
class Figure:
  """A PNG in the results folder: `draw` fills a fresh matplotlib figure of `size` inches."""
  file: str
  caption: str
  draw: Callable
  size: tuple = (10, 4)


@dataclasses.dataclass(frozen=True)
class Result:
  title: str
  command: str
  data: dict
  body: Sequence = ()  # markdown strings and Tables, in reading order
  figures: Sequence[Figure] = ()


def command_line(module: str) -> str:
  """The command that reproduces this process: `python -m module` and its flags."""
  return ' '.join([f'python -m {module}'] + sys.argv[1:])


def write(result: Result, out_dir, tensorboard_dir=DEFAULT_TENSORBOARD_DIR) -> None:
  out = Path(out_dir)
  write_json(out / 'results.json', {'command': result.command, **result.data})
  parts = [f'# {result.title}', f'Command: `{result.command}`']
  parts += [p.markdown() if isinstance(p, Table) else p for p in result.body]
  for figure in result.figures:
    fig = plt.figure(figsize=figure.size)
    figure.draw(fig)
    fig.tight_layout()
    fig.savefig(out / figure.file, dpi=100)
    plt.close(fig)
    parts.append(f'![{figure.caption}]({figure.file})')
  _write_atomic(out / 'README.md', '\n\n'.join(parts) + '\n')
  if tensorboard_dir is not None:
    _write_scalars(Path(tensorboard_dir) / out.name, result.data)


def write_json(path, data: dict) -> None:
  """One JSON file, written whole or not at all (a partial measurement's own file, or a
  script whose output is one file rather than a results folder)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  _write_atomic(path, json.dumps(data, indent=1, default=float) + '\n')


def _write_atomic(path: Path, text: str) -> None:
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(text)
  tmp.replace(path)


def flattened(data: dict, prefix: str = '') -> dict:
  """Nested dicts as one {'a/b/c': value} level (TensorBoard's tag paths)."""
  out = {}
  for key, value in data.items():
    if isinstance(value, dict):
      out.update(flattened(value, f'{prefix}{key}/'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _write_scalars(directory: Path, data: dict) -> None:
  with SummaryWriter(str(directory)) as writer:
    for tag, value in scalars(flattened(data)).items():
      writer.add_scalar(tag, value, 0)
