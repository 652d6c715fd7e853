"""torchtitan's components, extended: checkpoint (and LoRA's), validation, metrics, LR schedule, loss, the
MoE balance loss; where torchtitan keeps its own (``torchtitan.components``)."""
