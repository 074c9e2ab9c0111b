"""The CPU engine installed by scripts/install.sh runs on every x86-64 machine
with AVX2, whatever CPU built it: no instruction beyond that baseline is
compiled in (a native build used AVX-512 and died with SIGILL elsewhere)."""

from __future__ import annotations

import llama_cpp

# Extensions that some x86-64 servers of this kind lack.
_BEYOND_BASELINE = ("AVX512", "AMX", "AVX_VNNI", "AVX10")


def compiled_features() -> list[str]:
    info = llama_cpp.llama_print_system_info().decode()
    return [part.split("=")[0].strip().removeprefix("CPU : ")
            for part in info.split("|") if part.strip().endswith("= 1")]


def test_the_installed_llama_cpp_build_needs_nothing_beyond_avx2() -> None:
    features = compiled_features()
    assert "AVX2" in features, features  # the build is the one we made, and it reports
    assert [f for f in features if f.startswith(_BEYOND_BASELINE)] == [], features
