# python -m pytest tests/test_readme.py -q
"""The README: CI runs its test command, its code snippets run, and it cites no file outside the repository."""

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


def test_the_readme_snippets_run():
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_the_repository_cites_no_file_it_does_not_contain():
    import re

    outside = re.compile(r"\b(METHOD|ENVIRONMENT|STYLE)\.md\b|\.\./shared")  # background files kept out of the repository
    for path in [ROOT / "README.md", *ROOT.glob("*.py"), *(ROOT / "tests").glob("*.py")]:
        found = outside.search(path.read_text())
        assert not found, f"{path.name} cites {found.group()}"
