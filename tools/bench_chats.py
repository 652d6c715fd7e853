"""The packing benchmarks' chats: synthetic conversations of the real Qwen3 tokenizer and template, their
lengths lognormal around a median of ~300 tokens, written as JSON lines (``tools/bench_packing.py``,
``tools/bench_document_attention.py``)."""

from __future__ import annotations

import json
from pathlib import Path

CHATS = 400
MEDIAN_TOKENS = 300
LENGTH_SIGMA = 0.6  # lognormal: 4x the median is the ~99th percentile
MAX_TOKENS = 1250
MIN_TOKENS = 64

WORDS = """the a of to and in is it that for on with as was at by this be are from or have an they which one
you were all we when there can more if no out so said what up its about into than them only other time new
some could these two may first then do any like my now over such our man me even most made after also did
many before must through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long get here between both life being under
never day same another know while last might us great old year off come since against go came right used
take three small large next early young important few public bad able value model train data token layer
loss step batch row chat answer question reason file code test function return list string number method
class module error result check read write line table memory device graph kernel shape sequence""".split()


def chat_tokenizer(tokenizer_dir: Path):
    """Our chat tokenizer (what the dataloader renders and marks with), on the directory's Qwen3 files."""
    from qwen3_titan_common.data import ChatTemplateTokenizer
    from qwen3_titan_common.data.chat import ChatTokenizer
    from qwen3_titan_common.data.tokens import DocumentTokenizer

    tokens = DocumentTokenizer(ChatTemplateTokenizer.Config().build(tokenizer_path=str(tokenizer_dir)))
    return ChatTokenizer(tokens), tokens.eos_id


def _words(rng, budget: int, word_tokens: dict[str, int]) -> str:
    """Words drawn from WORDS until they make about ``budget`` tokens, a sentence every dozen or so."""
    out, used = [], 0
    while used < budget:
        word = WORDS[int(rng.integers(len(WORDS)))]
        out.append(word)
        used += word_tokens[word]
        if len(out) % 12 == 0:
            out[-1] += "."
            used += 1
    return " ".join(out) + "."


def make_chats(path: Path, tokenizer_dir: Path, n: int = CHATS, seed: int = 0) -> list[dict]:
    """``n`` chats written as JSON lines; returns each one's token ids and trained flags (EOS appended, as
    our dataloader appends it), measured with the real tokenizer and template."""
    import numpy as np
    from qwen3_titan_common.data.conversation import Conversation

    chats, eos = chat_tokenizer(tokenizer_dir)
    fast = chats.tokens.fast
    # Every word after the first of a message follows a space, so its tokens are those of " word".
    word_tokens = {w: len(fast.encode(" " + w, add_special_tokens=False).ids) for w in WORDS}
    rng = np.random.default_rng(seed)
    targets = np.clip(rng.lognormal(np.log(MEDIAN_TOKENS), LENGTH_SIGMA, n), MIN_TOKENS, MAX_TOKENS)
    system = {"role": "system", "content": "You are a helpful assistant. Answer briefly and exactly."}

    def overhead(exchanges: int) -> int:
        empty = [system] + [
            {"role": r, "content": ""} for _ in range(exchanges) for r in ("user", "assistant")
        ]
        return len(chats.tokenize(Conversation(empty))[0].ids)

    overheads = {k: overhead(k) for k in (1, 2, 3)}
    docs = []
    with open(path, "w") as f:
        for target in targets:
            exchanges = int(rng.integers(1, 4))
            budget = max(8 * exchanges, int(target) - overheads[exchanges])
            shares = rng.dirichlet(np.ones(exchanges)) * budget
            messages = [system]
            for share in shares:
                user = max(3, int(share * rng.uniform(0.15, 0.4)))
                messages.append({"role": "user", "content": _words(rng, user, word_tokens)})
                messages.append(
                    {"role": "assistant", "content": _words(rng, max(3, int(share) - user), word_tokens)}
                )
            f.write(json.dumps({"messages": messages}) + "\n")
            tokens = chats.tokenize(Conversation(messages))[0]
            ids, trained = list(tokens.ids), [bool(t) for t in tokens.trained]
            if ids[-1] != eos:
                ids.append(eos)
                trained.append(False)
            docs.append({"ids": ids, "trained": trained})
    return docs
