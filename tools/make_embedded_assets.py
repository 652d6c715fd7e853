"""Generate the embedded default assets shipped inside ``qwen3_titan_common``.

The toolkit needs a corpus and a tokenizer that work offline and carry no
licence doubts, so that smoke tests and first runs never hit the network.
This script builds both from what every Python install already has:

* a corpus of the docstrings of CPython's standard library (PSF License 2.0),
  one JSON line per module;
* a 4096-entry byte-level BPE tokenizer trained on that corpus, written in the
  Hugging Face layout that torchtitan's ``HuggingFaceTokenizer`` and
  ``transformers.AutoTokenizer`` both load;
* ``PROVENANCE.md`` recording how the files were made, with their sha256.

Run from the repository root::

    uv run python tools/make_embedded_assets.py
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import platform
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

GENERATOR_COMMAND = "uv run python tools/make_embedded_assets.py"

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / "packages/common/src/qwen3_titan_common/assets/default"
CORPUS_PATH = ASSETS_DIR / "corpus" / "corpus.jsonl"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
# Not generated here: the embedded model's config.json, whose positions bound the tokenizer's inputs.
MODEL_CONFIG_PATH = ASSETS_DIR / "model" / "config.json"
PROVENANCE_PATH = ASSETS_DIR / "PROVENANCE.md"

# The corpus must stay small enough to ship in a wheel.
CORPUS_TARGET_MIN_BYTES = 1_500_000
CORPUS_MAX_BYTES = 3_000_000

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Listed first so the trainer gives them ids 0, 1, 2: their ids never move
# when the corpus or the number of merges changes.
SPECIAL_TOKENS = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

# Qwen-style ChatML, kept on one line so Jinja's trim/lstrip settings in HF and
# torchtitan cannot introduce stray whitespace.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Top-level modules whose import has side effects (opens a browser or a
# window, prints, runs tests, writes cache files) or pulls in a GUI toolkit,
# plus distutils, which setuptools shadows with its own copy inside a venv.
SKIPPED_TOP_LEVEL_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "__phello__",
        "__hello__",
        "test",
        "lib2to3",
        "distutils",
    }
)

# os.py lives in the stdlib directory; lib-dynload (C extensions) is below it.
STDLIB_DIR = Path(os.__file__).resolve().parent

# Reprs of objects embedded in generated docstrings (e.g. dataclass defaults)
# carry memory addresses that change from run to run.
MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def is_skipped_module(dotted_name: str) -> bool:
    parts = dotted_name.split(".")
    # Underscore modules are C accelerators or private helpers whose docs are
    # re-exported (and so collected) through their public counterparts;
    # __main__ submodules run their program when imported.
    if any(part.startswith("_") for part in parts):
        return True
    if any(part in {"test", "tests", "idle_test"} for part in parts):
        return True
    return parts[0] in SKIPPED_TOP_LEVEL_MODULES


def is_from_stdlib_dir(module) -> bool:
    """Reject modules shadowed by installed packages (e.g. setuptools' distutils).

    Only CPython's own files are covered by the PSF licence we claim.
    """
    module_file = getattr(module, "__file__", None)
    if module_file is None:
        return True  # compiled into the interpreter
    path = Path(module_file).resolve()
    if "site-packages" in path.parts or "dist-packages" in path.parts:
        return False
    return path.is_relative_to(STDLIB_DIR)


@contextlib.contextmanager
def silenced_process_output() -> Iterator[None]:
    """Send fd 1 and 2 to /dev/null, so C-level writes from imports vanish too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in (*saved_fds, devnull):
            os.close(fd)


def import_quietly(name: str):
    with silenced_process_output():
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - some modules raise SystemExit etc.
            return None


def clean_doc(obj) -> str:
    try:
        doc = inspect.getdoc(obj)
    except Exception:  # noqa: BLE001 - exotic objects can fail in getdoc
        return ""
    if not isinstance(doc, str):
        return ""
    return MEMORY_ADDRESS.sub("", doc).strip()


def is_owned_by(obj, module_name: str) -> bool:
    """True for members defined in the module (or in a private helper module).

    Members re-exported from another public module are documented under the
    module that defines them, which the walk visits on its own.
    """
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return True
    is_private_owner = any(part.startswith("_") for part in owner.split("."))
    return owner == module_name or is_private_owner


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def public_members(namespace: dict) -> list[tuple[str, object]]:
    return sorted((name, value) for name, value in namespace.items() if not name.startswith("_"))


def is_documented_class_attribute(name: str, value) -> bool:
    # Dunder methods are kept because __init__ and friends often carry the
    # most useful text of a class; generic slot-wrapper docs ("Return
    # self==value.") survive only once thanks to corpus-wide deduplication.
    if is_dunder(name):
        return inspect.isroutine(value)
    if name.startswith("_"):
        return False
    return inspect.isroutine(value) or inspect.isdatadescriptor(value)


def documented_class_attributes(cls) -> list[tuple[str, object]]:
    """Methods, properties and descriptors defined on the class itself.

    Inherited attributes are documented under the class that defines them.
    """
    return [
        (name, value)
        for name, value in sorted(safe_vars(cls).items())
        if is_documented_class_attribute(name, value)
    ]


def safe_vars(obj) -> dict:
    try:
        return dict(vars(obj))
    except TypeError:
        return {}


def class_sections(qualified_name: str, cls) -> Iterator[tuple[str, str]]:
    yield qualified_name, clean_doc(cls)
    for name, value in documented_class_attributes(cls):
        yield f"{qualified_name}.{name}", clean_doc(getattr(cls, name, value))


def module_sections(module) -> Iterator[tuple[str, str]]:
    """Yield (heading, docstring) for the module and its public members."""
    module_name = module.__name__
    yield module_name, clean_doc(module)
    for name, value in public_members(safe_vars(module)):
        if not is_owned_by(value, module_name):
            continue
        qualified_name = f"{module_name}.{name}"
        if inspect.isclass(value):
            yield from class_sections(qualified_name, value)
        elif inspect.isroutine(value):
            yield qualified_name, clean_doc(value)


def render_document(module, seen_docs: set[str]) -> str | None:
    """Render one module as text, dropping docstrings already seen anywhere."""
    module_doc_lines = [f"# {module.__name__}"]
    has_content = False
    for heading, doc in module_sections(module):
        if not doc or doc in seen_docs:
            continue
        seen_docs.add(doc)
        has_content = True
        if heading == module.__name__:
            module_doc_lines.append(doc)
        else:
            module_doc_lines.append(f"## {heading}\n{doc}")
    if not has_content:
        return None
    return "\n\n".join(module_doc_lines).strip()


def submodule_names(package) -> list[str]:
    package_path = getattr(package, "__path__", None)
    if package_path is None:
        return []
    prefix = package.__name__ + "."
    return [info.name for info in pkgutil.iter_modules(package_path, prefix)]


def discover_stdlib_modules() -> list[str]:
    """All importable public stdlib modules, packages walked recursively."""
    pending = [name for name in sys.stdlib_module_names if not is_skipped_module(name)]
    found: set[str] = set()
    while pending:
        name = pending.pop()
        module = import_quietly(name)
        if module is None or not is_from_stdlib_dir(module):
            continue
        found.add(name)
        pending.extend(child for child in submodule_names(module) if not is_skipped_module(child))
    return sorted(found)


def build_corpus_documents() -> list[str]:
    seen_docs: set[str] = set()
    documents: list[str] = []
    total_bytes = 0
    # Reading attributes can also warn (deprecated aliases such as typing.io).
    with silenced_process_output():
        for name in discover_stdlib_modules():
            document = render_document(import_quietly(name), seen_docs)
            if document is None:
                continue
            document_bytes = len(document.encode("utf-8")) + 1
            if total_bytes + document_bytes > CORPUS_MAX_BYTES:
                break
            documents.append(document)
            total_bytes += document_bytes
    return documents


def write_corpus(documents: list[str]) -> None:
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    with CORPUS_PATH.open("w", encoding="utf-8", newline="\n") as corpus_file:
        for document in documents:
            corpus_file.write(json.dumps({"text": document}, ensure_ascii=False))
            corpus_file.write("\n")


def train_tokenizer(documents: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any input text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"trained vocab has {tokenizer.get_vocab_size()} entries, "
            f"expected {VOCAB_SIZE}: the corpus is too small"
        )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} did not get id {expected_id}")
    return tokenizer


def special_token_entry(token: str) -> dict:
    return {
        "content": token,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def model_max_length() -> int:
    """The embedded model's ``max_position_embeddings``, the tokenizer's ``model_max_length``: the
    length transformers truncates at and warns past, and the model has no positions beyond it."""
    return json.loads(MODEL_CONFIG_PATH.read_text())["max_position_embeddings"]


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(token_id): special_token_entry(token) for token_id, token in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length(),
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(tokenizer) -> None:
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(TOKENIZER_DIR / "tokenizer.json"), pretty=True)
    config_text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (TOKENIZER_DIR / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")


def count_tokens(tokenizer, documents: list[str]) -> int:
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    return sum(len(encoding.ids) for encoding in encodings)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generated_files() -> list[Path]:
    return [
        CORPUS_PATH,
        TOKENIZER_DIR / "tokenizer.json",
        TOKENIZER_DIR / "tokenizer_config.json",
    ]


def render_provenance(document_count: int, token_count: int) -> str:
    import tokenizers

    corpus_bytes = CORPUS_PATH.stat().st_size
    python_version = platform.python_version()
    checksum_lines = "\n".join(
        f"{sha256_of(path)}  {path.relative_to(ASSETS_DIR).as_posix()}" for path in generated_files()
    )
    skipped = ", ".join(f"`{name}`" for name in sorted(SKIPPED_TOP_LEVEL_MODULES))
    return f"""# Embedded default assets: provenance

Generated by `tools/make_embedded_assets.py`; do not edit these files by hand.

## Corpus (`corpus/corpus.jsonl`)

- **Content**: the docstrings of CPython {python_version}'s standard library,
  as returned by `inspect.getdoc`: for each public module in
  `sys.stdlib_module_names` (sorted), the module docstring and the docstrings
  of its public classes, functions and methods (and of the public attributes
  defined on those classes). One JSON line `{{"text": ...}}` per module; the
  text starts with the heading `# <module name>`, members follow under
  `## <qualified name>` headings.
- **Walk**: packages are walked recursively with `pkgutil.iter_modules`.
  Left out: private (`_`-prefixed) modules, `__main__` and test modules,
  modules imported from outside the stdlib directory (e.g. setuptools'
  `distutils` shim), modules that fail to import on this build, and these
  packages (side effects on import, GUI toolkits, shadowed by setuptools):
  {skipped}.
- **Filtering**: each distinct docstring appears once in the
  whole corpus (first occurrence in sorted order wins), memory addresses
  (` at 0x...`) are removed, texts are stripped.
- **Licence**: the docstrings are part of CPython's source code, copyright
  the Python Software Foundation, distributed under the PSF License Agreement
  for Python (Python Software Foundation License Version 2, SPDX `PSF-2.0`).
  See <https://docs.python.org/3/license.html>.
- **Generated with**: {platform.python_implementation()} {python_version}
  on {platform.system()} {platform.machine()}. Other Python versions or builds
  (different C extensions available) yield a different corpus.
- **Size**: {corpus_bytes} bytes, {document_count} documents,
  {token_count} tokens with the tokenizer below
  ({token_count / corpus_bytes:.4f} tokens per byte of the file).

## Tokenizer (`tokenizer/`)

- Byte-level BPE trained with `tokenizers` {tokenizers.__version__} on the
  corpus texts (`BpeTrainer`, default `min_frequency`, all 256 byte symbols
  as the initial alphabet).
- Vocabulary: exactly {VOCAB_SIZE} entries, special tokens included.
- Special tokens at the start of the vocabulary: `{EOS_TOKEN}` = 0
  (EOS and padding), `{IM_START_TOKEN}` = 1, `{IM_END_TOKEN}` = 2.
- Pre-tokenizer `ByteLevel(add_prefix_space=False)` (GPT-2 split regex),
  decoder `ByteLevel`, no normalizer, no post-processor (no BOS is added;
  `bos_token` is null).
- `tokenizer_config.json`: `PreTrainedTokenizerFast`, `add_bos_token=false`,
  `add_eos_token=false`, `model_max_length={model_max_length()}` (the model's
  `max_position_embeddings`, read from `model/config.json`), a ChatML
  chat template using `{IM_START_TOKEN}` / `{IM_END_TOKEN}`.

## How to regenerate

From the repository root:

```
{GENERATOR_COMMAND}
```

## Checksums (sha256, paths relative to this directory)

```
{checksum_lines}
```
"""


def main() -> None:
    documents = build_corpus_documents()
    write_corpus(documents)
    corpus_bytes = CORPUS_PATH.stat().st_size
    if corpus_bytes < CORPUS_TARGET_MIN_BYTES:
        print(f"warning: corpus is only {corpus_bytes} bytes", file=sys.stderr)
    tokenizer = train_tokenizer(documents)
    write_tokenizer(tokenizer)
    token_count = count_tokens(tokenizer, documents)
    PROVENANCE_PATH.write_text(render_provenance(len(documents), token_count), encoding="utf-8")
    print(
        f"corpus: {corpus_bytes} bytes, {len(documents)} documents, "
        f"{token_count} tokens ({token_count / corpus_bytes:.4f} tokens/byte)"
    )
    print(f"assets written to {ASSETS_DIR.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
