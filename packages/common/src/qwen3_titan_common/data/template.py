"""The tokenizer's chat template, rendered the way transformers renders it.

torchtitan's ``HuggingFaceTokenizer`` compiles the template in a Jinja environment of its own, which
lacks transformers' ``{% generation %}`` tag: a tokenizer whose template marks the assistant's text
with it (the way to ask for transformers' ``return_assistant_tokens_mask``) cannot even be built.
``ChatTemplateTokenizer`` keeps the template's source instead and renders it with transformers'
``render_jinja_template``, which also fills ``reasoning_content`` from its other names and passes the
assistant spans of ``{% generation %}`` blocks. It is the tokenizer ``build_trainer_config`` composes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

from qwen3_titan_common.data.sources import DatasetError

# transformers' own test for the tag (render_jinja_template warns on the same pattern).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateTokenizer(HuggingFaceTokenizer):
    """torchtitan's Hugging Face tokenizer, its chat template kept as source and rendered by transformers."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        pass

    chat_template: str | None = None

    def set_chat_template(self, template: str) -> None:
        # Compiled by transformers on first use (and cached there); a template that does not compile
        # then fails the chat records that need it, not a plain-text run that never renders it.
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("No chat template set. Call set_chat_template() first.")
        return ChatRenderer(self.chat_template, {}).render(messages, **kwargs).text


def template_source(tokenizer: BaseTokenizer) -> str | None:
    """The chat template of ``tokenizer`` as source text, or None when it has none.

    ``ChatTemplateTokenizer`` kept it. torchtitan's own ``HuggingFaceTokenizer`` keeps only its compiled
    form, so its source is read again from the tokenizer directory in the order torchtitan read it
    (``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template``).
    """
    if isinstance(tokenizer, ChatTemplateTokenizer):
        return tokenizer.chat_template
    directory = getattr(tokenizer, "tokenizer_path", None)
    if directory is None:
        return None
    jinja_file = Path(directory) / HuggingFaceTokenizer.CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = Path(directory) / "tokenizer_config.json"
    if config_file.is_file():
        template = json.loads(config_file.read_text()).get("chat_template")
        if template is not None and not isinstance(template, str):
            raise DatasetError(
                f"{config_file}: 'chat_template' is {type(template).__name__} (expected one template as a "
                "string; write the one to train with to chat_template.jinja)"
            )
        return template
    return None


@dataclass(frozen=True)
class Rendering:
    text: str
    generation_spans: list[tuple[int, int]]  # characters inside {% generation %} blocks, in order


class ChatRenderer:
    """One chat template, rendered by transformers with the tokenizer's special tokens as variables."""

    def __init__(self, source: str, variables: dict[str, Any]):
        self.source = source
        self.variables = variables
        self.has_generation_tags = bool(_GENERATION_TAG.search(source))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Rendering:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, spans = render_jinja_template(
            [messages],
            tools=tools,
            chat_template=self.source,
            return_assistant_tokens_mask=self.has_generation_tags,
            add_generation_prompt=add_generation_prompt,
            **{**self.variables, **kwargs},
        )
        return Rendering(rendered[0], [tuple(s) for s in spans[0]] if spans else [])
