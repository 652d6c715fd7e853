"""Training data from the user's own files: plain text packed, chat with assistant-only loss.

- ``sources``: ``--dataloader.dataset`` resolved to files and read by record index
- ``records``: what a text or chat record must hold; bad-record lines
- ``tokens``, ``chat``: token ids, the chat template and which tokens are the assistant's
- ``packing``: fixed-shape rows
- ``dataset``: order, sharding, epochs and checkpointed position
- ``loader``: the torchtitan dataloader (``TextChatDataLoader.Config``)

User documentation: docs/data.md.
"""

from qwen3_titan_common.data.loader import TextChatDataLoader
from qwen3_titan_common.data.records import BadRecordError
from qwen3_titan_common.data.sources import DatasetError

__all__ = ["BadRecordError", "DatasetError", "TextChatDataLoader"]
