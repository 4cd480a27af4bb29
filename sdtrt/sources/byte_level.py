"""Byte-level BPE's alphabet, shared by the offline CLIP and Qwen tokenizers presets build."""

from __future__ import annotations


def bytes_to_unicode() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (the GPT-2/CLIP table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
