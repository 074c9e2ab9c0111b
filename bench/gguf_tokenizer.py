"""A Hugging Face tokenizer folder built offline from a GGUF's own metadata.

The benchmark tools (inference-perf, GuideLLM) count tokens with a Hugging
Face tokenizer, which they would fetch from the hub; here there is no hub, and
transformers' GGUF loader pulls torch. The GGUF already holds the vocabulary,
the merges and the token types: this reads them with the standard library (no
`gguf`, no llama.cpp) and writes `tokenizer.json` (the `tokenizers` format),
`tokenizer_config.json` and `special_tokens_map.json` into a folder that
`AutoTokenizer.from_pretrained(folder)` loads.

Supported: byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) with
the pre-tokenizers of PRE_TOKENIZERS; anything else is refused by name.

    python bench/gguf_tokenizer.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO

# GGUF value types (ggml's gguf.h, GGUF_TYPE_*): struct format of the scalars.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# A cap on what one metadata value may claim, so a corrupt file fails fast
# instead of allocating gigabytes.
_MAX_ITEMS = 10_000_000
_MAX_STRING = 1 << 24

# llama.cpp's token types (llama_token_type): which become added tokens.
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the Hugging Face pre-tokenizer that splits text the way
# llama.cpp's pre-tokenizer of that name does (llama-vocab.cpp).
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    # SmolLM (and StarCoder): each digit alone, then GPT-2's split.
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "starcoder": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}


class GGUFError(ValueError):
    """The file is not a GGUF this module can read, or its tokenizer is unsupported."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("truncated GGUF file")
    return data


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    if n > _MAX_STRING:
        raise GGUFError(f"a GGUF string claims {n} bytes")
    return _read(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, n = _unpack(f, "<I"), _unpack(f, "<Q")
        if n > _MAX_ITEMS:
            raise GGUFError(f"a GGUF array claims {n} items")
        return [_value(f, item_kind) for _ in range(n)]
    raise GGUFError(f"unknown GGUF value type {kind}")


def read_metadata(path: Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF (v2 or v3), tensors left unread."""
    with path.open("rb") as f:
        if _read(f, 4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file")
        version = _unpack(f, "<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        _unpack(f, "<Q")  # tensor count
        n_kv = _unpack(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, _unpack(f, "<I"))
        return meta


def tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizers` serialisation of the GGUF's vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {model!r}: only byte-level BPE (gpt2) is supported")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer.ggml.pre {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = meta.get("tokenizer.ggml.merges", [])
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == _CONTROL}
             for i, t in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": byte_level | {"trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def _token(meta: dict[str, Any], name: str) -> str | None:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    i = meta.get(f"tokenizer.ggml.{name}_token_id")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """What AutoTokenizer reads beside tokenizer.json: the class, special tokens, template."""
    arch = meta.get("general.architecture", "")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
    }
    for name in ("bos", "eos", "unk", "pad"):
        token = _token(meta, "padding" if name == "pad" else "unknown" if name == "unk" else name)
        if token is not None:
            config[f"{name}_token"] = token
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def write_tokenizer_dir(gguf: Path, out: Path) -> Path:
    """Write the tokenizer folder for `gguf` into `out`; returns `out`."""
    meta = read_metadata(gguf)
    out.mkdir(parents=True, exist_ok=True)
    config = tokenizer_config(meta)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(meta), ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    specials = {k: v for k, v in config.items() if k.endswith("_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python bench/gguf_tokenizer.py MODEL.gguf OUT_DIR", file=sys.stderr)
        return 2
    try:
        out = write_tokenizer_dir(Path(argv[0]), Path(argv[1]))
    except (OSError, GGUFError) as e:
        print(f"gguf_tokenizer: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
