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


# Longest first: UTF-32 LE starts with UTF-16 LE's mark. iconv's plain UTF-16/UTF-32 read the mark and drop it.
_UTF_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def _encoding(head: bytes) -> str | None:
    """The UTF-16/32 encoding ``head`` is in, as iconv names it (by its byte-order mark, or ASCII text with
    every other byte NUL), or None."""
    for mark, encoding in _UTF_BOMS:
        if head.startswith(mark):
            return encoding
    sample = head[: len(head) - len(head) % 2]
    if len(sample) >= 4:
        even, odd = sample[0::2], sample[1::2]
        if odd.count(0) == len(odd) and even.count(0) == 0:
            return "UTF-16LE"
        if even.count(0) == len(even) and odd.count(0) == 0:
            return "UTF-16BE"
    return None


def _not_utf8(head: bytes) -> str | None:
    """Where the first line of ``head`` stops being UTF-8, or None. Only the first line: a UTF-8 file with one
    bad line later is a bad record of its own (named by its line), a file whose first line is not UTF-8 is in
    another encoding (a multi-byte character cut by the end of the sample is fine)."""
    first = head.lstrip(b"\r\n").split(b"\n", 1)[0]
    try:
        first.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start >= len(first) - 3 and err.reason == "unexpected end of data":
            return None
        offset = err.start + len(head) - len(head.lstrip(b"\r\n"))
        return f"byte 0x{first[err.start]:02x} at offset {offset}"
    return None


def not_json_lines(path: Path, name: str) -> str | None:
    """Why ``path`` (named ``name`` in messages) cannot be JSON Lines text, or None if it may be."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, (what, fix) in _COMPRESSED.items():
        if head.startswith(magic):
            return f"{name}: is {what}, not JSON Lines text; decompress it first ({fix.format(path=path)}) and pass the result"
    if head.startswith(b"PAR1"):
        return f"{name}: is a Parquet file, not JSON Lines; give it the .parquet suffix"
    encoding = _encoding(head)
    if encoding is not None:
        return (
            f"{name}: is {encoding} text, not UTF-8; convert it first (`iconv -f {encoding} -t UTF-8 {path} > "
            "OUT.jsonl`) and pass the result"
        )
    if b"\x00" in head:
        return f"{name}: is a binary file, not JSON Lines text (it holds NUL bytes); expected one JSON object per line"
    where = _not_utf8(head)
    if where is not None:
        return (
            f"{name}: is not UTF-8 text ({where}; Latin-1 or Windows-1252, perhaps); convert it first "
            f"(`iconv -f LATIN1 -t UTF-8 {path} > OUT.jsonl`, with the encoding it is in) and pass the result"
        )
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return (
            f"{name}: holds a JSON array, not JSON Lines; expected one JSON object per line: convert it with "
            f"{_ARRAY_TO_LINES}"
        )
    return None
