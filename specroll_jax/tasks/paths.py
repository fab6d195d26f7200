"""Where the project finds its assets: the one place that says so.

Bundled with the repository (what the tests and the default commands need):
  STORIES260K_DIR  the stories260K Llama (MIT), a real 260K-parameter checkpoint with its
                   tokenizer and reference outputs.
Outside it (too large to commit), the math datasets' data directory, chosen in this order:
  1. an explicit path (a flag or config field, e.g. --config.task.data_dir);
  2. the SPECROLL_DATA_DIR environment variable;
  3. ../shared/data beside the repository.
"""
import os
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
STORIES260K_DIR = Path(__file__).resolve().parent / 'stories260K'

DATA_DIR_VARIABLE = 'SPECROLL_DATA_DIR'
DEFAULT_DATA_DIR = REPO_DIR.parent / 'shared' / 'data'


def data_dir(explicit: str | os.PathLike | None = None, layout: tuple = ()) -> Path:
  """The data directory: `explicit`, else $SPECROLL_DATA_DIR, else ../shared/data.

  Args:
    layout: the files a data directory holds, relative to it (tasks.data's table), for the
      error message.

  Raises:
    FileNotFoundError: the chosen directory does not exist; the message says which of the
      three sources chose it and the layout expected there.
  """
  if explicit:
    path, chosen_by = Path(explicit), 'the data_dir given'
  elif os.environ.get(DATA_DIR_VARIABLE):
    path, chosen_by = Path(os.environ[DATA_DIR_VARIABLE]), f'${DATA_DIR_VARIABLE}'
  else:
    path, chosen_by = DEFAULT_DATA_DIR, f'the default (${DATA_DIR_VARIABLE} is not set)'
  path = path.resolve()
  if not path.is_dir():
    raise FileNotFoundError(
        f'data directory not found: {path}, chosen by {chosen_by}. Pass a data_dir '
        f'(e.g. --config.task.data_dir) or set {DATA_DIR_VARIABLE} to a directory holding '
        f'{", ".join(layout) or "the datasets"} (any subset: each dataset reads its own '
        f'files).')
  return path


def data_dir_exists() -> bool:
  """Whether the data directory chosen without an explicit path exists."""
  try:
    data_dir()
  except FileNotFoundError:
    return False
  return True
