"""What a Qwen3 checkpoint is: its ``config.json`` read into an architecture, and the published ones."""
