"""Write a tokenizer-only model folder for Dynamo's mocker engine: byte-level BPE, ChatML template, a config.

The mocker simulates the engine (no weights): it needs the tokenizer, its chat template and the
config's sizes. Runs with the Dynamo venv's python (`tokenizers` is there).
Usage: make_tiny_tokenizer.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(out: Path) -> None:
    """Save tokenizer.json, tokenizer_config.json, config.json and generation_config.json under `out`."""
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tmp / "tokenizer.json"))
    eos, bos = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    files = {
        "tokenizer_config.json": {
            "bos_token": SPECIALS[0],
            "eos_token": SPECIALS[2],
            "pad_token": SPECIALS[0],
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHATML,
        },
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "vocab_size": len(vocab),
            "max_position_embeddings": 4096,
            "eos_token_id": eos,
            "bos_token_id": bos,
            "torch_dtype": "float16",
        },
        "generation_config.json": {"eos_token_id": eos},
    }
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content))
    tmp.rename(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
