"""What a data file really is, from its first bytes, when its name says JSON Lines.

A compressed, binary or JSON-array file read line by line fails on every line, or worse, on
one giant "line"; naming what it is, with the fix, saves the user reading N bad-record lines.
"""

from __future__ import annotations

from pathlib import Path

SNIFF_BYTES = 8192
_COMPRESSED = {
    b"\x1f\x8b": ("gzip-compressed", "`gunzip -k {path}`"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "`zstd -d {path}`"),
    b"BZh": ("bzip2-compressed", "`bunzip2 -k {path}`"),
    b"\xfd7zXZ\x00": ("xz-compressed", "`unxz -k {path}`"),
    b"PK\x03\x04": ("a zip archive", "`unzip {path}`"),
}
_ARRAY_TO_LINES = (
    '`python -c "import json,sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]" < IN > OUT.jsonl`'
)


def not_json_lines(path: Path, name: str) -> str | None:
    """Why ``path`` (named ``name`` in messages) cannot be JSON Lines text, or None if it may be."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, (what, fix) in _COMPRESSED.items():
        if head.startswith(magic):
            return f"{name}: is {what}, not JSON Lines text; decompress it first ({fix.format(path=path)}) and pass the result"
    if head.startswith(b"PAR1"):
        return f"{name}: is a Parquet file, not JSON Lines; give it the .parquet suffix"
    if b"\x00" in head:
        return f"{name}: is a binary file, not JSON Lines text (it holds NUL bytes); expected one JSON object per line"
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return (
            f"{name}: holds a JSON array, not JSON Lines; expected one JSON object per line: convert it with "
            f"{_ARRAY_TO_LINES}"
        )
    return None
