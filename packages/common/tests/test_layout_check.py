"""``train --check-layout``'s verdict: ok within the derived bound of one rank's losses, not ok beyond it.

(The whole command, both runs through torchrun: tests/test_parallel_layouts.py.)
"""

from qwen3_titan_common.launcher.layout_check import CHECK_STEPS, LayoutCheck
from qwen3_titan_common.models.layout import Layout
from qwen3_titan_common.protocols.summary import RunSummary
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

CHECK = LayoutCheck(
    layout=Layout(world_size=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1),
    local_batch=8,
    global_batch=8,
    seq_len=256,
    layers=4,
)


def _summary(losses, export=None, dropped_share=None) -> RunSummary:
    return RunSummary(
        first_step=1, last_step=CHECK_STEPS, total_steps=CHECK_STEPS, tokens=0, train_seconds=1.0,
        tokens_per_second=None, first_loss=losses[0], final_loss=losses[-1], peak_memory_gib=None,
        memory_source="host RSS", checkpoint=None, export=export, dropped_share=dropped_share,
        losses=[[step, loss] for step, loss in enumerate(losses, start=1)],
    )  # fmt: skip


def test_losses_within_the_bound_are_ok_and_beyond_it_not(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model")
    one_rank = [8.3, 8.1, 7.6]
    reference = _summary(one_rank, export=str(model))
    bound = ModelBounds.from_dir(model).loss_atol(8.3, tokens=8 * 256, seq_len=256, passes=1)

    ok, line = CHECK.verdict(_summary([8.3 + bound / 2, 8.1, 7.6]), reference)
    assert ok and line.endswith(": ok"), line
    assert "tensor 2" in line and "2 of the model's 4 layers" in line and "global batch 8 x 256" in line
    assert "largest loss difference" in line and "at step 1" in line

    ok, line = CHECK.verdict(_summary([8.3 + 2 * bound, 8.1, 7.6]), reference)
    assert not ok and "NOT ok" in line and "at step 1" in line, line

    # A fixed-capacity exchange that dropped assignments trains other numbers, within the bound or not; one that
    # dropped none is ok.
    ok, line = CHECK.verdict(_summary([8.3, 8.1, 7.6], dropped_share=0.166), reference)
    assert not ok and "NOT ok" in line and "dropped 16.6% of the routed assignments" in line, line
    assert "--moe.capacity_factor" in line
    ok, line = CHECK.verdict(_summary([8.3, 8.1, 7.6], dropped_share=0.0), reference)
    assert ok and line.endswith(": ok"), line
