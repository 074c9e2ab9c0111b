"""bench/serve.sh as a user on another machine runs it: its Python found on
that machine's PATH (a version manager's shim that exits 127 passed over),
no path of the machine it was written on, and the repository's own record
of results left alone unless asked. The script runs for real, against stubs
of the Pythons it finds that write down what they were asked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL_TOOLS = ("bash", "dirname", "basename", "mkdir", "rm", "touch", "tail", "cat", "cp")
# What a stub Python does: writes its name and arguments down; answers a
# version check as the Python it stands for would (exit 0: >= 3.12); makes
# a venv's python (a copy of itself) for `-m venv DIR`.
STUB = """#!/bin/sh
echo "$0 $*" >>{log}
case "$1" in
  -c) exit {version_rc} ;;
  -m) [ "$2" = venv ] && mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
esac
exit 0
"""
# pyenv's shim for a version this directory has not selected.
SHIM = '#!/bin/sh\necho "pyenv: $(basename "$0"): command not found" >&2\nexit 127\n'


def stub(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def rig(tmp: Path) -> tuple[Path, dict[str, str], Path]:
    repo = tmp / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "serve.sh", repo / "bench" / "serve.sh")
    log = tmp / "calls.log"
    bindir = tmp / "bin"
    bindir.mkdir()
    for name in REAL_TOOLS:
        real = shutil.which(name)
        assert real, name
        (bindir / name).symlink_to(real)
    stub(bindir / "python3.12", SHIM)
    stub(bindir / "python3.13", STUB.format(log=log, version_rc=0))
    stub(bindir / "python3", STUB.format(log=log, version_rc=1))  # a 3.11
    stub(repo / ".venv" / "bin" / "python", STUB.format(log=log, version_rc=0))
    env = {"PATH": str(bindir), "HOME": str(tmp / "home")}
    return repo, env, log


def run(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "bench/serve.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_first_python_that_runs_makes_the_venvs_and_results_stay_out_of_the_repo(
    tmp_path: Path,
) -> None:
    repo, env, log = rig(tmp_path)
    done = run(repo, env, "--tools", "guidellm")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    cache = tmp_path / "home" / ".cache" / "llmgw" / "bench-serve"
    venvs = [c for c in calls if " -m venv " in c]
    assert venvs == [f"{tmp_path}/bin/python3.13 -m venv {cache}/inference-perf",
                     f"{tmp_path}/bin/python3.13 -m venv {cache}/guidellm"], calls
    (served,) = [c for c in calls if "bench/serve.py" in c]
    python, script = served.split()[:2]
    assert Path(repo, python).resolve() == repo / ".venv/bin/python", served
    assert script == "bench/serve.py", served
    # The results go to the cache; a caller's --results comes after, so it wins.
    assert f"--results {cache}/RESULTS.md --tools guidellm" in served, served


def test_no_python_that_runs_is_said_and_nothing_of_another_machine_is_tried(
    tmp_path: Path,
) -> None:
    repo, env, log = rig(tmp_path)
    (tmp_path / "bin" / "python3.13").unlink()
    done = run(repo, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "LLMGW_BENCH_PY312" in done.stderr, done.stderr
    assert " -m venv " not in (log.read_text() if log.exists() else "")

    (repo / ".venv" / "bin" / "python").unlink()
    done = run(repo, env)
    assert done.returncode == 1 and "scripts/install.sh" in done.stderr, done.stderr


def test_no_tracked_file_names_a_path_of_the_machine_it_was_written_on() -> None:
    """A path into the work or root folder is one machine's checkout or home."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            timeout=60, check=True).stdout.decode().split("\0")
    found = []
    for name in filter(None, listed):
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 2**20:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                  if re.search(r"(?<![\w.])/(work|root)/", line)]
    assert not found, "\n".join(found)
