"""Write a tiny, seeded, randomly-initialised llama-architecture GGUF for llama-server.

Runs under the interpreter that has `gguf` (scripts/setup-real-engines.sh puts it
in .cache/llama-venv); needs no torch and no download.

Tokenizer: byte-level BPE ("gpt2" in GGUF terms) with the 256 byte tokens, a few
merges and the ChatML specials, plus a ChatML chat template, so both
/v1/completions and /v1/chat/completions work.

Output restriction: residual dimension 0 holds a constant (embedding column 0 is 1,
no layer writes it, the layer norms mask it out), and the output matrix puts a
large negative weight on it for every token but printable ASCII and newline.
So sampling only yields printable ASCII — an invalid UTF-8 byte made llama-server
answer 500 mid-stream — and never EOS: every generation runs exactly to max_tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("Ġ", "a"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "s"),
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte → printable-unicode map that byte-level BPE vocabularies use."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def write_model(
    out: Path, hidden: int, layers: int, heads: int, kv_heads: int, ff: int, ctx: int, seed: int
) -> int:
    """Write the GGUF to `out`; return the vocabulary size."""
    rng = np.random.default_rng(seed)
    symbols = byte_symbols()
    tokens = [symbols[b] for b in range(256)]
    types = [gguf.TokenType.NORMAL] * 256
    merges = []
    for left, right in MERGES:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        types.append(gguf.TokenType.NORMAL)
    for special in SPECIALS:
        tokens.append(special)
        types.append(gguf.TokenType.CONTROL)
    n_vocab = len(tokens)
    bos, eos = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")

    allowed = np.zeros(n_vocab, dtype=bool)
    allowed[0x20:0x7F] = True
    allowed[0x0A] = True
    allowed[256 : 256 + len(MERGES)] = True  # every merge is printable ASCII

    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"cachewitness-tiny-llama-h{hidden}-l{layers}")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_eot_token_id(eos)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        """A seeded normal matrix; numpy (rows, cols) is ggml ne (cols, rows)."""
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    emb = mat(n_vocab, hidden, 0.5)
    emb[:, 0] = 1.0  # the constant channel
    w.add_tensor("token_embd.weight", emb)
    norm = np.ones(hidden, dtype=np.float32)
    norm[0] = 0.0  # layers never see the constant channel
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm)
        w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, hidden, hidden**-0.5))
        w.add_tensor(p + "attn_k.weight", mat(kv_heads * head_dim, hidden, hidden**-0.5))
        w.add_tensor(p + "attn_v.weight", mat(kv_heads * head_dim, hidden, hidden**-0.5))
        attn_out = mat(hidden, heads * head_dim, (heads * head_dim) ** -0.5)
        attn_out[0, :] = 0.0  # never write the constant channel
        w.add_tensor(p + "attn_output.weight", attn_out)
        w.add_tensor(p + "ffn_norm.weight", norm)
        w.add_tensor(p + "ffn_gate.weight", mat(ff, hidden, hidden**-0.5))
        w.add_tensor(p + "ffn_up.weight", mat(ff, hidden, hidden**-0.5))
        down = mat(hidden, ff, ff**-0.5)
        down[0, :] = 0.0
        w.add_tensor(p + "ffn_down.weight", down)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    output = mat(n_vocab, hidden, 1.0)
    output[~allowed, 1:] = 0.0
    # Banned tokens get logit -1e4 × (the constant channel): never sampled.
    output[:, 0] = np.where(allowed, 0.0, -1.0e4)
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_vocab


def main() -> None:
    """Parse the command line and write the model."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tmp = a.out.with_name(a.out.name + ".tmp")
    n_vocab = write_model(tmp, a.hidden, a.layers, a.heads, a.kv_heads, a.ff, a.ctx, a.seed)
    tmp.replace(a.out)  # a half-written model is never picked up
    print(f"wrote {a.out}: vocab={n_vocab} hidden={a.hidden} layers={a.layers}")


if __name__ == "__main__":
    main()
