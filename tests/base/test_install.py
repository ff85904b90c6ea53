"""An install that travels: `pip install --target DIR .` (not editable) holds the demo excerpt and the
committed models, so `python -m tforce run` with no model and no prompt works from another folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_an_installed_tforce_runs_its_default_model_and_prompt_from_another_folder(tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO)], check=True, cwd=tmp_path)
    assert (site / "tforce" / "data" / "demo_excerpt.txt").is_file()
    env = {k: v for k, v in os.environ.items() if k != "TFORCE_DEMO_MODELS"}  # the default, as a user gets it
    env["PYTHONPATH"] = str(site)
    where = subprocess.run([sys.executable, "-c", "import tforce.paths as p; print(p.PACKAGE); print(p.MODELS)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(site / "tforce"), str(site / "tforce" / "_models")]  # the installed copy, not the checkout
    r = subprocess.run([sys.executable, "-m", "tforce", "run", "-n", "8", "--method", "ar", "--temperature", "0"],
                       cwd=elsewhere, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "no prompt given: using the demo's excerpt" in r.stderr and "tforce: ar: 8 tokens after" in r.stderr
    assert r.stdout.strip()
