"""Hugging Face model directories: read, check, and write what ``transformers`` loads."""
