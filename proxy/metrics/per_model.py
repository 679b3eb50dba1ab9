"""llama.cpp's router: one Prometheus text per model, merged into one exposition with a `model` label.

A llama-server router (no `--model`) answers `/metrics` only with `?model=` (ggml-org/llama.cpp
#22879; tools/server/server-models.cpp proxies it to that model's child server). The children's
samples carry no model label and share family names, so their texts cannot simply be appended:
every family's lines must stay together, under one `# HELP`/`# TYPE`. Sans-IO: bytes in, bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ROUTER_METRICS_QUERY", "merge_per_model"]

# `autoload=false`: a router loads a model its request names unless told not to (router_validate_model).
ROUTER_METRICS_QUERY = "/metrics?autoload=false&model="


def _escaped(value: str) -> bytes:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode()


def _labelled(line: bytes, model: bytes) -> bytes:
    """A sample line with `model="..."` first among its labels."""
    brace = line.find(b"{")
    space = line.find(b" ")
    if brace != -1 and (space == -1 or brace < space):
        inner = b"," if line[brace + 1 : brace + 2] != b"}" else b""
        return line[: brace + 1] + b'model="' + model + b'"' + inner + line[brace + 1 :]
    return line[:space] + b'{model="' + model + b'"}' + line[space:]


def merge_per_model(texts: Sequence[tuple[str, bytes]]) -> bytes:
    """One exposition from each model's: families in first-seen order, each sample labelled by model."""
    heads: dict[bytes, list[bytes]] = {}  # family -> its HELP and TYPE lines (the first text's)
    samples: dict[bytes, list[bytes]] = {}
    for model, text in texts:
        family = b""
        label = _escaped(model)
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith(b"#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in (b"HELP", b"TYPE"):
                    family = parts[2]
                    heads.setdefault(family, [])
                    samples.setdefault(family, [])
                    if len(heads[family]) < 2 and line not in heads[family]:
                        heads[family].append(line)
                continue
            samples.setdefault(family, []).append(_labelled(line, label))
            heads.setdefault(family, [])
    out = [line for family in samples for line in (*heads.get(family, ()), *samples[family])]
    return b"\n".join(out) + b"\n" if out else b""
