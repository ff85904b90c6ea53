"""The packages of the wheel: tforce's own, and the models committed in models/, which travel as
tforce/_models so that an installed tforce runs its default model from any folder (defaults.REPO_MODELS).
Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["tforce", "tforce.*"]) + ["tforce._models"],
      package_dir={"tforce._models": "models"})
