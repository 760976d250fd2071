"""Run the consumer scripts of this folder in one process of the consumers' Python, so that
torch, transformers, compressed-tensors and llama.cpp's library load once for all the checks
(tests/fp4lab/test_export_consumers.py starts one per test module):

    python tests/consumers/serve.py

Each line of stdin is a JSON list ``[script, arg, ...]`` (``script``: a file name in this
folder); the script runs as ``__main__`` with those arguments, as ``python script arg ...``
would run it, and one JSON line answers on stdout: ``{"ok": true}``, or ``{"ok": false,
"error": <the traceback>}``. What the scripts print goes to stderr. Ends at the end of stdin.
"""

import json
import runpy
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    answers, sys.stdout = sys.stdout, sys.stderr  # stdout carries the answers alone
    for line in sys.stdin:
        script, *args = json.loads(line)
        path = HERE / script
        sys.argv = [str(path), *args]
        try:
            if path.parent != HERE or not path.is_file():
                raise FileNotFoundError(f"no consumer script {script!r} in {HERE}")
            runpy.run_path(str(path), run_name="__main__")
            answer = {"ok": True}
        except (Exception, SystemExit):  # a script's exit too: reported, not fatal
            answer = {"ok": False, "error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
