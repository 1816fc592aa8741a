# python -m pytest tests/test_readme.py -q
"""CI must run the README's test command: the two files name the same line."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line.strip() for line in readme if "python -m pytest tests" in line]
    assert len(commands) == 1, "README.md must give exactly one test command line"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[0] in ci


def test_method_files_never_import_trl_or_peft():
    for name in ("opsd.py", "eval.py"):
        lines = (ROOT / name).read_text().splitlines()
        bad = [l for l in lines if l.strip().startswith(("import trl", "from trl", "import peft", "from peft"))]
        assert not bad, f"{name}: {bad}"
