"""Builds the embedded preference set (``default-pairs``) from the embedded corpus, deterministically.

    uv run python -m tools.make_preference_pairs     # rewrites assets/default/pairs/pairs.jsonl

Each member section of the corpus (``## name`` and its docstring, ``data`` of the standard library's
docstrings) gives one pair: the prompt is the heading, ``chosen`` the first paragraph of that member's own
docstring, and ``rejected`` the first paragraph of another member's, drawn from another module with a fixed
seed. The preference to learn is "the docstring that documents this name", which a small model picks up in
tens of steps: a demonstration set for ``train --objective dpo``, not a benchmark. Paragraphs are cut at a
sentence end within ``MAX_CHARS`` characters so that a pair fits the debug model's 256-token rows.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from qwen3_titan_common.assets import default_assets_dir, default_corpus_path

MAX_CHARS = 240
MIN_CHARS = 40
SEED = 0
PAIRS = 1024  # every k-th section, spread over the whole corpus
PAIRS_FILE = default_assets_dir() / "pairs" / "pairs.jsonl"


def _first_paragraph(text: str) -> str | None:
    paragraph = text.strip().split("\n\n")[0].strip()
    if len(paragraph) > MAX_CHARS:
        cut = paragraph[:MAX_CHARS]
        end = max(cut.rfind(". "), cut.rfind(".\n"))
        if end < MIN_CHARS:
            return None
        paragraph = cut[: end + 1]
    return paragraph if len(paragraph) >= MIN_CHARS else None


def sections(corpus: Path) -> list[tuple[str, str, str]]:
    """(module, member heading, first paragraph) of every member section with a usable docstring."""
    found = []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        module = text.split("\n", 1)[0].removeprefix("# ").strip()
        for part in re.split(r"\n(?=## )", text)[1:]:
            heading, _, body = part.partition("\n")
            paragraph = _first_paragraph(body)
            if paragraph is not None:
                found.append((module, heading.strip(), paragraph))
    return found


def pairs(found: list[tuple[str, str, str]]) -> list[dict[str, str]]:
    rng = random.Random(SEED)
    out = []
    step = max(1, len(found) // PAIRS)
    for module, heading, paragraph in found[::step][:PAIRS]:
        while True:
            other_module, _, other = found[rng.randrange(len(found))]
            if other_module != module and other != paragraph:
                break
        out.append({"prompt": f"{heading}\n", "chosen": paragraph, "rejected": other})
    return out


def main() -> None:
    written = pairs(sections(default_corpus_path()))
    PAIRS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with PAIRS_FILE.open("w", encoding="utf-8") as f:
        for record in written:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{PAIRS_FILE}: {len(written)} pairs")


if __name__ == "__main__":
    main()
