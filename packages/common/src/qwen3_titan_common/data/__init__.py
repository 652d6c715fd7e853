"""Training data from the user's own files: plain text packed, chat with assistant-only loss.

- ``sources``: ``--dataloader.dataset`` resolved to files and read by record index
- ``records``: what a text record must hold; bad-record lines
- ``conversation``: what a chat record must hold (messages, reasoning, tool calls, tools)
- ``template``: the tokenizer the Trainer builds (``ChatTemplateTokenizer``), the chat template rendered
- ``turns``, ``chat``: where assistant turns lie in a rendering; token ids and which are trained
- ``tokens``: token ids and character offsets
- ``packing``: fixed-shape rows
- ``dataset``: order, sharding, epochs and checkpointed position
- ``loader``: the torchtitan dataloader (``TextChatDataLoader.Config``)

User documentation: docs/data.md.
"""

from qwen3_titan_common.data.loader import TextChatDataLoader
from qwen3_titan_common.data.records import BadRecordError
from qwen3_titan_common.data.sources import DatasetError
from qwen3_titan_common.data.template import ChatTemplateTokenizer

__all__ = ["BadRecordError", "ChatTemplateTokenizer", "DatasetError", "TextChatDataLoader"]
