"""The ``README.md`` model card of an export: what the Hub and ``huggingface_hub`` read, and what a person reads.

Written with huggingface_hub's ``ModelCard``/``ModelCardData`` (the metadata block the Hub parses:
``base_model`` where the starting checkpoint's Hub id is known, ``library_name: transformers``, tags), then a
short body: the base model, the backend and config, the data, the steps, the final loss and the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

CARD_NAME = "README.md"


@dataclass(frozen=True)
class CardFacts:
    base_model: str | None  # where the weights came from: a directory or Hub id; None for a random start
    base_model_hub_id: str | None  # the Hub id of that checkpoint, when known
    architecture: str  # e.g. "Qwen3ForCausalLM, 28 layers, hidden 1024, 0.60B parameters"
    backend: str  # e.g. "native-backend (torchtitan --module qwen3_titan_native --config debug)"
    data: str
    step: int
    total_steps: int
    loss: float | None
    loss_step: int | None  # the step whose logged loss ``loss`` is
    dtype: str
    command: str
    objective: str = (
        "next-token prediction (supervised fine-tuning)"  # what the loss trained, e.g. DPO's settings
    )


def source_hub_id(model_dir: str | Path | None) -> str | None:
    """The ``base_model`` of the starting directory's own model card, if it names one (our exports do)."""
    if model_dir is None:
        return None
    card = Path(model_dir) / CARD_NAME
    if not card.is_file():
        return None
    try:
        base = ModelCard.load(card).data.base_model
    except Exception:  # a README that is not a model card: nothing to inherit
        return None
    if isinstance(base, list):
        base = base[0] if base else None
    return base if isinstance(base, str) and base else None


def model_card(facts: CardFacts) -> ModelCard:
    data = ModelCardData(
        base_model=facts.base_model_hub_id,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["qwen3", "torchtitan", "qwen3-titan", *(["dpo"] if facts.objective.startswith("DPO") else [])],
    )
    started = (
        f"`{facts.base_model}`" if facts.base_model else "random initialisation (the config's architecture)"
    )
    if facts.base_model_hub_id and facts.base_model != facts.base_model_hub_id:
        started += f" ([{facts.base_model_hub_id}](https://huggingface.co/{facts.base_model_hub_id}))"
    loss = "not logged"
    if facts.loss is not None:
        loss = f"{facts.loss:.4f}" + (
            f" (logged at step {facts.loss_step})" if facts.loss_step != facts.step else ""
        )
    body = f"""
# A Qwen3 model trained with qwen3-titan

Trained with [torchtitan](https://github.com/pytorch/torchtitan) through qwen3-titan and exported in the
Hugging Face layout: `transformers.AutoModelForCausalLM.from_pretrained` loads this directory.

| | |
|---|---|
| base model | {started} |
| architecture | {facts.architecture} |
| backend | {facts.backend} |
| data | {facts.data} |
| objective | {facts.objective} |
| steps | {facts.step} of {facts.total_steps} |
| loss | {loss} |
| dtype on disk | {facts.dtype} |

Command line:

```bash
{facts.command}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
