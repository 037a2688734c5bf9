"""`sao` loads sao/cli.py for every command: the heavy libraries wait until a command needs them."""

import json
import subprocess
import sys

HEAVY = ("torch", "numpy", "transformers", "deepspeed", "sentence_transformers")


def test_loading_the_cli_imports_no_heavy_library():
    probe = f"import json, sys, sao.cli; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == []
