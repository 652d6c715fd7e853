"""Model locations that are not local directories: say so, in the form the user typed, with how to fetch them.

Runs never download weights (every rank would, and a run must not depend on the network), so a
remote name is refused before anything starts, with the command that makes it local.
"""

from __future__ import annotations

import re
from pathlib import Path

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$")
# "Qwen/Qwen3-0.6B": the Hub's owner/name form (letters, digits, '-', '_', '.'), one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_remote(text: str) -> bool:
    return bool(_SCHEME.match(text))


def looks_like_hub_id(text: str) -> bool:
    """``owner/name`` that is not a local path: a Hub repository id, not a typo of a directory."""
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def _fetch_hint(text: str) -> str:
    match = _SCHEME.match(text)
    if match is None:
        return f"`hf download {text} --local-dir DIR`"
    scheme, rest = match["scheme"].lower(), match["rest"].strip("/")
    if scheme == "hf":
        repo = rest.removeprefix("models/")
        return f"`hf download {repo} --local-dir DIR`"
    if scheme == "s3":
        return f"`aws s3 cp --recursive {text} DIR`"
    if scheme in ("gs", "gcs"):
        return f"`gcloud storage cp -r {text} DIR`"
    return "your usual tool (e.g. `hf download ORG/NAME --local-dir DIR` for the Hugging Face Hub)"


def remote_model_message(text: str, flag: str) -> str | None:
    """The one-line refusal for a remote or Hub model name, or None for a local path."""
    if is_remote(text):
        return f"{flag} {text}: a remote location; runs read local directories only: download it with {_fetch_hint(text)} and pass DIR"
    if looks_like_hub_id(text):
        return (
            f"{flag} {text}: no such local directory; if it is a Hugging Face Hub model, download it first with "
            f"{_fetch_hint(text)} and pass DIR"
        )
    return None
