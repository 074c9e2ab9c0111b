"""The router compiled: its own source, and the server protocol's that
every request runs through first, built into C extensions by mypyc.

Every request's and every stream chunk's CPU in the gateway is mostly the
interpreter running the router's Python (docs/design/hot-path.md, "The
router compiled"). mypyc compiles that same source, type annotations and
all, into C extension modules that run it with native calls, attributes in
slots and unboxed ints: 18-19% less CPU a request under load, measured
side by side (bench/RESULTS.md, "The router compiled by mypyc").
Nothing is written for the compiler alone: the source stays the one the
tests, the type checker and a developer read, and the gateway runs it as
plain Python wherever no compiled copy matches it.

`scripts/install.sh` builds the copy (`python -m app.compiled build`) into
the virtual environment it was built for (`home()`): nothing compiled enters
the source tree, and a copy never outlives its interpreter. Its manifest
names every source file it was built from, by content: a package's
`__init__` (`package_path`) puts the compiled modules ahead of the source
only while every one of those files is unchanged, so an edited router runs
as edited, in pure Python, until the next build. `LLMGW_ROUTER_COMPILED=off`
runs the pure Python whatever was built (a profiler sees Python frames
there, not C). `state()` says which runs and why, for the gateway's start
line and `llmgw_build_info`.

The build is portable: mypyc's C compiled with the interpreter's own flags
and `-O3`, never for the CPU that builds it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

# The packages compiled, each whole but for its `__init__`, which loads them.
PACKAGES = ("app.router", "app.router.usage")
# Modules compiled beside them, each alone in its package (whose `__init__`
# loads it the same way): the server's protocol, which every connection and
# request runs through before the router (docs/design/hot-path.md, "The
# router compiled").
MODULES = ("app.gateway.http1",)
# The compiled modules share one library of mypyc's runtime and their code,
# a module of the first package.
GROUP = "app.router._compiled"
MANIFEST = "manifest.json"
OFF = "LLMGW_ROUTER_COMPILED"
ROOT = Path(__file__).resolve().parent.parent  # holds app/

# What `package_path` found, once per process: None until asked.
_state: str | None = None
_usable: bool = False


def home() -> Path:
    """Where this environment's compiled copy lives: beside its interpreter's
    packages, so a new environment starts with none."""
    return Path(sys.prefix) / "llmgw-compiled"


def sources(root: Path = ROOT) -> list[Path]:
    """The source files compiled, relative to `root`, in a stable order."""
    out: list[Path] = []
    for package in PACKAGES:
        folder = root.joinpath(*package.split("."))
        out += sorted(p.relative_to(root) for p in folder.glob("*.py")
                      if p.name != "__init__.py")
    return out + [Path(*module.split(".")).with_suffix(".py") for module in MODULES]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(root: Path, mypyc: str) -> dict[str, object]:
    """What a copy built now from the source under `root` records: this
    interpreter, the compiler's version, and each source file's digest."""
    return {"python": sys.version, "mypyc": mypyc,
            "sources": {str(f): _digest(root / f) for f in sources(root)}}


def check(copy: Path, root: Path = ROOT) -> tuple[bool, str]:
    """Whether the compiled copy at `copy` may run the source under `root`
    in this process, and why (or why not)."""
    if os.environ.get(OFF, "").lower() in ("off", "0", "false", "no"):
        return False, f"pure Python: {OFF}=off"
    manifest = copy / MANIFEST
    try:
        made = json.loads(manifest.read_text())
    except FileNotFoundError:
        return False, ("pure Python: no compiled copy in this environment "
                       "(scripts/install.sh builds it)")
    except (OSError, ValueError) as exc:
        return False, f"pure Python: the compiled copy's manifest is unreadable ({exc})"
    if not isinstance(made, dict) or made.get("python") != sys.version:
        return False, "pure Python: the compiled copy was built for another interpreter"
    built = made.get("sources")
    if not isinstance(built, dict):
        return False, "pure Python: the compiled copy's manifest names no sources"
    now = {str(p): p for p in sources(root)}
    if set(now) != set(built):
        return False, "pure Python: the router's files changed since the compiled copy was built"
    for name, path in now.items():
        try:
            digest = _digest(root / path)
        except OSError:
            return False, f"pure Python: cannot read {name}"
        if digest != built[name]:
            return False, f"pure Python: {name} changed since the compiled copy was built"
    return True, f"compiled by mypyc {made.get('mypyc', '?')}"


def package_path(package: str, path: list[str]) -> list[str]:
    """A compiled package's `__path__`: its compiled modules first when the
    copy matches the source (checked once a process), else `path` as it is."""
    global _state, _usable
    if _state is None:
        _usable, _state = check(home())
        if _usable:
            # The library every compiled module loads: if it cannot load
            # here, nothing compiled runs.
            first = importlib.import_module(PACKAGES[0])
            saved = list(first.__path__)
            first.__path__[:0] = [str(home().joinpath(*PACKAGES[0].split(".")))]
            try:
                importlib.import_module(GROUP + "__mypyc")
            except ImportError as exc:
                _usable, _state = False, f"pure Python: the compiled copy does not load ({exc})"
            finally:
                first.__path__[:] = saved
    if not _usable:
        return path
    return [str(home().joinpath(*package.split("."))), *path]


def state() -> str:
    """Which router runs in this process, and why: "compiled by mypyc X" or
    "pure Python: REASON". (Imports the router if it was not yet.)"""
    importlib.import_module(PACKAGES[0])
    assert _state is not None
    return _state


def build_tree(root: Path, work: Path) -> None:
    """What mypyc builds in: a copy of the package under `root` (mypyc
    writes its output beside its input, and its type check reads every
    module the router imports), and the type check's settings: strict, as
    the project's own, but a package that is not installed, such as an
    extra's (OpenTelemetry, imported only when tracing is on), is read as
    untyped rather than failing the build."""
    import shutil

    shutil.copytree(root / "app", work / "app",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "static"))
    (work / "mypy.ini").write_text(
        "[mypy]\npython_version = 3.11\nstrict = True\nignore_missing_imports = True\n")


def build(root: Path = ROOT, dest: Path | None = None) -> Path:
    """Compiles the router's source under `root` into `dest` (this
    environment's `home()`), replacing what was there once it has built;
    returns `dest`. Needs mypy (mypyc) and a C compiler."""
    import shutil
    import subprocess
    import tempfile

    import mypy.version

    dest = dest or home()
    files = sources(root)
    with tempfile.TemporaryDirectory(prefix="llmgw-compile-") as tmp:
        work = Path(tmp)
        build_tree(root, work)
        setup = (
            "import sys\n"
            "from setuptools import setup\n"
            "from mypyc.build import mypycify\n"
            f"setup(name='llmgw-compiled', ext_modules=mypycify({[str(f) for f in files]!r}, "
            f"group_name={GROUP!r}, opt_level='3'), "
            "script_args=['build_ext', '--inplace'])\n")
        (work / "setup.py").write_text(setup)
        env = {k: v for k, v in os.environ.items() if k not in ("CFLAGS", "CPPFLAGS")}
        done = subprocess.run([sys.executable, "setup.py"], cwd=work, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError("mypyc failed:\n" + (done.stdout + done.stderr)[-4000:])
        staged = Path(str(dest) + ".new")
        shutil.rmtree(staged, ignore_errors=True)
        for so in work.rglob("*.so"):
            if so.relative_to(work).parts[0] != "app":
                continue  # setuptools' own build folder
            target = staged / so.relative_to(work)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, target)
        # Of the copy compiled: a file edited meanwhile is not what runs.
        (staged / MANIFEST).write_text(json.dumps(manifest(work, mypy.version.__version__),
                                                  indent=1, sort_keys=True))
    old = Path(str(dest) + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    staged.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["build"]:
        print(f"compiled the router into {build()}")
        return 0
    if args == ["state"]:
        # Run as `-m`, this file is `__main__`: the router's loader is the
        # module of the package's own name.
        loader = importlib.import_module("app.compiled")
        print(loader.state())
        return 0
    print("usage: python -m app.compiled build|state", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
