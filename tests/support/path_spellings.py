"""The engines' path decoders, written as data, and the spellings of a path each one accepts.

What an engine routes on is its own decoding of the request path, once:

- vLLM and SGLang: uvicorn sets `scope["path"] = urllib.parse.unquote(raw_path)` and Starlette's
  router matches that (`%XX` in either case of hex digit; anything else stays as it is).
- llama-server: cpp-httplib's `decode_path_component` (vendor/cpp-httplib, 0.53 and 0.58 read):
  `%XX`, and `%u` (lowercase u only) with four hex digits as that code point in UTF-8, except
  that `%uD800`..`%uDFFF` decode to nothing at all; anything else stays as it is.

`decode` is a reference implementation of those rules; `spellings` draws raw paths that the
given decoder turns into a given path, so that tests can check what each one reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

__all__ = ["CPP_HTTPLIB", "DECODERS", "STARLETTE", "Decoder", "decode", "spellings"]

_HEX = "0123456789abcdefABCDEF"


@dataclass(frozen=True)
class Decoder:
    """One engine HTTP library's path decoding rules."""

    name: str
    unicode_escape: bool  # `%uXXXX` (lowercase u, any case of hex digit) is a code point
    drops_surrogates: bool  # `%uD800`..`%uDFFF` decode to nothing


STARLETTE = Decoder("starlette (uvicorn: urllib.parse.unquote)", unicode_escape=False, drops_surrogates=False)
CPP_HTTPLIB = Decoder("cpp-httplib decode_path_component", unicode_escape=True, drops_surrogates=True)
DECODERS: dict[str, tuple[Decoder, ...]] = {
    "vllm": (STARLETTE,),
    "sglang": (STARLETTE,),
    "llamacpp": (CPP_HTTPLIB,),
}
# mindnano's server is not named by its docs: both rule sets.
DECODERS["mindnano"] = (STARLETTE, CPP_HTTPLIB)


def _hex(text: str, start: int, count: int) -> int | None:
    digits = text[start : start + count]
    if len(digits) != count or any(c not in _HEX for c in digits):
        return None
    return int(digits, 16)


def decode(decoder: Decoder, raw: str) -> str:
    """`raw` (a path, ASCII) as `decoder` decodes it, once; bytes that are not UTF-8 as U+FFFD."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == "%" and decoder.unicode_escape and raw[i + 1 : i + 2] == "u":
            code = _hex(raw, i + 2, 4)
            if code is not None:
                if not (decoder.drops_surrogates and 0xD800 <= code <= 0xDFFF):
                    out += chr(code).encode("utf-8")
                i += 6
                continue
        if raw[i] == "%":
            byte = _hex(raw, i + 1, 2)
            if byte is not None:
                out.append(byte)
                i += 3
                continue
        out += raw[i].encode("utf-8")
        i += 1
    return out.decode("utf-8", "replace")


def _cased(digits: str, mask: int) -> str:
    """`digits` with the case of each hex letter taken from one bit of `mask`."""
    return "".join(c.upper() if mask >> (k % 8) & 1 else c for k, c in enumerate(digits))


def _spell(decoder: Decoder, path: str, choices: bytes) -> str:
    """One spelling of `path`, three choice bytes per character (all zero: `path` itself).

    Per character: how it is written (literal, `%XX`, or `%uXXXX` where the decoder takes it),
    the case of its hex digits, and whether a surrogate escape (read as nothing) goes before it.
    """
    out = ["/"]
    ways = 3 if decoder.unicode_escape else 2
    for k, char in enumerate(path[1:]):
        way, mask, gap = choices[3 * k], choices[3 * k + 1], choices[3 * k + 2]
        if decoder.drops_surrogates and gap >= 192:
            out.append("%u" + _cased(f"{0xD800 + gap * 37 % 0x800:04x}", mask))
        if way % ways == 0:
            out.append(char)
        elif way % ways == 1:
            out.append("%" + _cased(f"{ord(char):02x}", mask))
        else:
            out.append("%u" + _cased(f"{ord(char):04x}", mask))
    return "".join(out)


def spellings(decoder: Decoder, path: str) -> st.SearchStrategy[str]:
    """Raw paths that `decoder` decodes to `path`; the leading `/` stays literal (the request line needs it)."""
    size = 3 * (len(path) - 1)
    return st.binary(min_size=size, max_size=size).map(lambda choices: _spell(decoder, path, choices))
