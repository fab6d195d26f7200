"""Where the shared, read-only assets live by default: ../shared beside the repository."""
from pathlib import Path

SHARED_DIR = Path(__file__).resolve().parents[3] / 'shared'
DATA_DIR = SHARED_DIR / 'data'
STORIES260K_DIR = SHARED_DIR / 'models' / 'stories260K'
