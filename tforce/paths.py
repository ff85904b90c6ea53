"""Where the files shipped with tforce are, wherever the module asking lives in the package.

MODELS: the models committed with tforce: models/ in a checkout (and an editable install), tforce/_models in
an installed wheel (setup.py puts them there). DATA: tforce/data (the demo excerpt)."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DATA = PACKAGE / "data"
MODELS = PACKAGE / "_models" if (PACKAGE / "_models").is_dir() else PACKAGE.parent / "models"
