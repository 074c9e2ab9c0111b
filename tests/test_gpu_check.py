"""scripts/gpu_check.py without a GPU: its steps up to discovery's and the
build's refusals, and the whole check against stand-ins (a `pynvml` replaying
an NVML recording, tests/fakes/nvml; the vLLM stand-in installed by the
agent's installer template), as subprocesses; its arguments, final line and
gauge check in process. NVML is the stand-in in every run, so the outcome is
the same on a machine with GPUs: no test here can start a real install."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
FAKE_NVML = ROOT / "tests" / "fakes" / "nvml"
FAKE_VLLM = ROOT / "tests" / "fakes" / "bin" / "vllm"
DATA = ROOT / "tests" / "data"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load()


def environment(tmp: Path, recording: Path, env: dict[str, str] | None) -> dict[str, str]:
    """NVML the stand-in replaying `recording`, no nvidia-smi on PATH, no
    `vllm` on PATH (else the agent takes it for the operator's own)."""
    path = tmp / "path"
    path.mkdir(exist_ok=True)
    for tool in ("sh", "mkdir", "chmod", "sleep", "dirname"):  # the templates' and shim's
        found = shutil.which(tool)
        assert found is not None, tool
        (path / tool).unlink(missing_ok=True)
        (path / tool).symlink_to(found)
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    full.update({"PATH": str(path), "PYTHONPATH": str(FAKE_NVML), "FAKE_NVML": str(recording),
                 "FAKE_VLLM_PYTHON": sys.executable, **(env or {})})
    return full


def run_check(tmp: Path, recording: Path, *args: str, env: dict[str, str] | None = None,
              ) -> tuple[int, list[str], float]:
    """The script as an operator runs it: (exit status, stdout lines, seconds)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=environment(tmp, recording, env), timeout=120, check=False)
    took = time.monotonic() - started
    return done.returncode, done.stdout.splitlines(), took


def model(tmp: Path) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def recording(tmp: Path, cuda: int) -> Path:
    """Two H100s as NVML reports them, on a driver of CUDA `cuda` (13000: 13.0)."""
    rec = json.loads((DATA / "nvml-2xh100-health.json").read_text())
    rec["nvmlSystemGetCudaDriverVersion"] = cuda
    path = tmp / "nvml.json"
    path.write_text(json.dumps(rec))
    return path


def test_no_gpu_fails_at_discovery_within_seconds(tmp_path: Path) -> None:
    work = tmp_path / "work"
    code, out, took = run_check(tmp_path, DATA / "nvml-no-driver.json",
                                "--model", str(tmp_path / "absent"), "--work-dir", str(work))
    assert code == 1, out
    assert out[-1] == ("gpu-check: FAILED at discovery: no GPU found: none (NVML: Driver Not "
                       "Loaded; nvidia-smi: nvidia-smi not found)"), out
    assert took < 15, f"{took:.1f} s to find no GPU"
    assert not (work / "engines").exists()  # nothing installed


def test_old_driver_fails_at_build_and_installs_nothing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    code, out, _ = run_check(tmp_path, recording(tmp_path, 12040),
                             "--model", str(model(tmp_path)), "--work-dir", str(work))
    assert code == 1, out
    assert out[-1] == ("gpu-check: FAILED at build: the driver's CUDA 12.4 is older than 12.9: "
                       "no vLLM build can run here"), out
    assert any("inventory: node gpu-check, 2 GPU(s)" in line for line in out), out
    assert not (work / "engines").exists()


def test_a_model_that_is_not_local_fails_before_the_build(tmp_path: Path) -> None:
    code, out, _ = run_check(tmp_path, recording(tmp_path, 13000),
                             "--model", "HuggingFaceTB/SmolLM2-135M-Instruct",
                             "--work-dir", str(tmp_path / "work"))
    assert code == 1, out
    assert out[-1].startswith("gpu-check: FAILED at config: --model "
                              "HuggingFaceTB/SmolLM2-135M-Instruct: not a local model"), out


# The build as the agent installs it, with the vLLM stand-in for vLLM: the
# installer takes 1.2 s and the check 0.6 s, so each figure can be told apart.
STAND_IN_BUILD = {
    "LLMGW_AGENT_VLLM_INSTALLER": (
        "sleep 1.2 && mkdir -p {venv}/bin {venv}/lib/python3/site-packages/"
        "vllm-{vllm_version}.dist-info && printf '#!/bin/sh\\nexec %s \"$@\"\\n' "
        f"{FAKE_VLLM} > {{venv}}/bin/vllm && chmod +x {{venv}}/bin/vllm"),
    "LLMGW_AGENT_VLLM_CHECK": "sleep 0.6 && test -x {venv}/bin/vllm",
}
FIGURES = re.compile(
    r"gpu-check: gpus=2 source=nvml cuda=13\.0 build=cu13 vllm=0\.33\.0 "
    r"install_s=(?P<install>[0-9.]+) check_s=(?P<check>[0-9.]+) start_s=[0-9.]+ "
    r"chat_ms=[0-9]+ completion_tokens=(?P<tokens>[0-9]+) metrics=ok")


def test_the_whole_check_passes_on_stand_ins_and_reuses_a_kept_build(tmp_path: Path) -> None:
    weights = model(tmp_path)
    args = ("--model", str(weights), "--work-dir", str(tmp_path / "work"))
    nvml = recording(tmp_path, 13000)
    code, out, _ = run_check(tmp_path, nvml, *args, env=STAND_IN_BUILD)
    assert left_behind(weights) == []
    first = FIGURES.fullmatch(out[-1])
    assert code == 0 and first is not None, "\n".join(out[-3:])
    assert float(first["install"]) >= 1.2 and float(first["check"]) >= 0.6, out[-1]
    assert int(first["tokens"]) >= 1
    assert any(line.startswith("the engine's process group is gone") for line in out), out
    # The same work directory again: the build is there, only checked.
    code, out, _ = run_check(tmp_path, nvml, *args, env=STAND_IN_BUILD)
    assert left_behind(weights) == []
    again = FIGURES.fullmatch(out[-1])
    assert code == 0 and again is not None, "\n".join(out[-3:])
    assert float(again["install"]) == 0.0 and float(again["check"]) >= 0.6, out[-1]


def engines_serving(weights: Path) -> list[int]:
    """Live (not zombie) processes serving `weights` (`... serve WEIGHTS ...`)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"serve" in argv and str(weights).encode() in argv and state != "Z":
            found.append(int(proc.name))
    return found


def left_behind(weights: Path) -> list[int]:
    """The engines of `weights` still running, killed: a failing test leaks none."""
    left = engines_serving(weights)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def test_sigterm_stops_the_engine_it_started(tmp_path: Path) -> None:
    """The engine runs in a session of its own (as the agent starts it): a
    device's time limit ending the check must not leave it on the GPU."""
    weights = model(tmp_path)
    env = environment(tmp_path, recording(tmp_path, 13000),
                      {**STAND_IN_BUILD, "FAKE_VLLM_STARTUP_DELAY": "60"})
    check = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(weights), "--work-dir", str(tmp_path / "w")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (started := engines_serving(weights)) and time.monotonic() < deadline:
            assert check.poll() is None, check.communicate()[0]
            time.sleep(0.2)
        assert started, "the engine never started"
        check.send_signal(signal.SIGTERM)
        out, _ = check.communicate(timeout=30)
    finally:
        check.kill()
        left = left_behind(weights)
    assert left == []
    assert check.returncode == 1, out
    assert out.splitlines()[-1] == ("gpu-check: FAILED at engine: interrupted (SIGTERM or "
                                    "SIGINT)"), out


# --- in process ------------------------------------------------------------------------


def test_arguments_and_their_defaults() -> None:
    args = gc.parse_args(["--model", "/m"])
    assert (args.model, args.work_dir, args.build, args.keep) == ("/m", None, "auto", False)
    assert (args.start_timeout, args.engine_arg) == (420.0, None)
    args = gc.parse_args(["--model", "/m", "--work-dir", "/w", "--build", "cu129", "--keep",
                          "--engine-arg=--enforce-eager", "--engine-arg=--dtype=half"])
    assert (str(args.work_dir), args.build, args.keep) == ("/w", "cu129", True)
    assert args.engine_arg == ["--enforce-eager", "--dtype=half"]


@pytest.mark.parametrize("argv", [["--model", "/m", "--build", "cpu"], ["--build", "cu13"]])
def test_a_build_it_cannot_check_or_no_model_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        gc.parse_args(argv)
    assert exited.value.code == 2


def test_the_figures_line() -> None:
    fig = gc.Figures(gpus=1, source="nvml", cuda="13.0", build="cu13", vllm="0.33.0",
                     install_s=312.44, check_s=8.06, start_s=71.25, chat_ms=41.6,
                     completion_tokens=16)
    assert fig.passed
    assert gc.figures_line(fig) == (
        "gpu-check: gpus=1 source=nvml cuda=13.0 build=cu13 vllm=0.33.0 install_s=312.4 "
        "check_s=8.1 start_s=71.2 chat_ms=42 completion_tokens=16 metrics=ok")
    fig.missing_metrics = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert not fig.passed
    assert gc.figures_line(fig).endswith(
        " metrics=missing:vllm:num_requests_waiting,vllm:kv_cache_usage_perc")
    # An operator's own vLLM: no version read, no CUDA version from nvidia-smi's banner.
    own = gc.Figures(gpus=8, source="nvidia-smi", build="operator")
    assert " cuda=- build=operator vllm=- install_s=0.0 " in gc.figures_line(own)


def test_a_failure_is_one_line_however_long_its_reason() -> None:
    reason = "cu13 (vLLM 0.33.0): install failed (exit 1); last lines:\nERROR: no network\n"
    assert gc.failed_line("build", reason) == (
        "gpu-check: FAILED at build: cu13 (vLLM 0.33.0): install failed (exit 1); "
        "last lines: ERROR: no network")
    long = gc.failed_line("engine", "x" * 5000)
    assert "\n" not in long and long.endswith("...")
    assert len(long) == len("gpu-check: FAILED at engine: ") + gc.MAX_REASON


def test_the_router_gauges_missing_from_a_metrics_page() -> None:
    page = "\n".join([
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
        "vllm:num_requests_waiting 2.0",
        'vllm:gpu_cache_usage_perc{engine="0"} 0.5',  # vLLM before 0.9's name
    ])
    assert gc.missing_metrics(page) == ("vllm:kv_cache_usage_perc",)
    assert gc.missing_metrics(page + '\nvllm:kv_cache_usage_perc{engine="0"} 0.5') == ()
    assert gc.missing_metrics("") == gc.ROUTER_METRICS


def test_a_local_model_is_a_folder_with_its_config_or_a_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert gc.model_path(str(gguf)) == gguf
    assert gc.model_path(str(model(tmp_path))) == tmp_path / "model"
    with pytest.raises(gc.StepFailed, match="not a local model"):
        gc.model_path(str(tmp_path))  # a folder without config.json
