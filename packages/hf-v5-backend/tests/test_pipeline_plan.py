"""The pipeline stages of the transformers model (``pipeline.py``): which decoder layers each holds, and the plans
refused in one line before launch (``parallelize.check_parallelism``, called by the trainer's checks)."""

from __future__ import annotations

import dataclasses

import pytest
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_hf_v5 import config_registry
from qwen3_titan_hf_v5.pipeline import stage_layers, stage_plan
from torchtitan.config import ParallelismConfig


@pytest.mark.parametrize(
    "num_layers, num_stages",
    # Up to as many stages as the layers, the embedding and the output (more are refused: below).
    [(layers, stages) for layers in (1, 2, 4, 7, 28) for stages in (2, 3, 4) if stages <= layers + 2],
)
def test_every_layer_is_in_one_stage_in_order(num_layers, num_stages):
    ranges = stage_layers(num_layers, num_stages)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))
    # Counted with the embedding and the output as a layer each, the stages differ by one at most.
    units = [len(r) + (s == 0) + (s == num_stages - 1) for s, r in enumerate(ranges)]
    assert max(units) - min(units) <= 1, units


def test_the_split_counts_the_embedding_and_the_output_as_torchtitan_does():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    # A looped schedule's 4 stages of a 2-layer model: the embedding alone, a layer each, the output alone.
    assert stage_layers(2, 4) == [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]
    assert stage_layers(4, 2, first_stage_less=0, last_stage_less=0) == [range(0, 2), range(2, 4)]
    assert stage_layers(6, 2, first_stage_less=2, last_stage_less=0) == [range(0, 2), range(2, 6)]


def _parallelism(**changes) -> ParallelismConfig:
    return dataclasses.replace(ParallelismConfig(), **{"pipeline_parallel_degree": 2, **changes})


def test_a_schedule_takes_its_stages_per_rank():
    assert len(stage_plan(_parallelism(pipeline_parallel_schedule="1F1B"), 4)) == 2
    assert len(stage_plan(_parallelism(pipeline_parallel_schedule="Interleaved1F1B"), 4)) == 4
    plan = stage_plan(
        _parallelism(pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_layers_per_stage=1), 6
    )
    assert [len(r) for r in plan] == [0, 1, 1, 1, 1, 1, 1, 0]


@pytest.mark.parametrize(
    "changes, num_layers, line",
    [
        ({"pipeline_parallel_degree": 8}, 2, r"^--parallelism.pipeline_parallel_degree: 8 pipeline stages for a model "
         r"of 2 decoder layers; use at most 4 stages$"),
        ({"pipeline_parallel_layers_per_stage": 1}, 4, r"^--parallelism.pipeline_parallel_layers_per_stage 1: makes 6 "
         r"stages of the model's 4 layers, expected exactly the 2 pipeline ranks"),
        ({"pipeline_parallel_schedule_csv": "s.csv"}, 4, r"^--parallelism.pipeline_parallel_schedule_csv: "
         r"hf-v5-backend runs torch's named schedules"),
        ({"module_fqns_per_model_part": [["tok_embeddings"], ["norm"]]}, 4, r"^--parallelism.module_fqns_per_model_part: "
         r"hf-v5-backend splits its stages by decoder layers"),
        ({"pipeline_parallel_first_stage_less_layers": 5}, 2, r"^--parallelism.pipeline_parallel_first_stage_less_layers"
         r" 5 / _last_stage_less_layers 1: more than stage 0's share"),
        ({"pipeline_parallel_schedule": "ZBVZeroBubble", "pipeline_parallel_layers_per_stage": 2}, 10,
         r"^--parallelism.pipeline_parallel_layers_per_stage 2: makes 6 stages of the model's 10 layers; "
         r"--parallelism.pipeline_parallel_schedule ZBVZeroBubble runs two stages on each of the 2 pipeline ranks"),
    ],
    ids=["more-stages-than-layers", "layers-per-stage", "csv-schedule", "module-lists", "first-stage-weight",
         "v-schedule"],
)  # fmt: skip
def test_a_plan_that_cannot_be_made_is_one_line_before_launch(changes, num_layers, line):
    config = config_registry.debug()
    config.parallelism = _parallelism(**changes)
    config.model_spec.model.hf_config["num_hidden_layers"] = num_layers
    with pytest.raises(UserInputError, match=line):
        config_registry.HFv5Trainer.prepare_backend(config)


def test_a_tied_checkpoint_runs_in_pipeline_stages_when_untied_on_purpose(tmp_path, monkeypatch, capfd):
    # No stage can hold both ends of one shared matrix; --hf_v5.untie_embeddings trains two (lm_head starts as a
    # copy of the embedding), which stages hold apart: the trainer's checks ask the backend what it trains.
    from qwen3_titan_hf_v5 import BACKEND
    from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
    from qwen3_titan_testing.edges import checks_in_process

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    model = make_tiny_checkpoint(tmp_path / "tied", tied=True)
    job = ["--hf-model", str(model), "--nproc", "2", "--parallelism.pipeline_parallel_degree", "2"]
    assert checks_in_process(BACKEND, [*job, "--out", str(tmp_path / "a")]) == 2
    assert "tie_word_embeddings true" in capfd.readouterr().err
    assert (
        checks_in_process(BACKEND, [*job, "--hf_v5.untie_embeddings", "--out", str(tmp_path / "b")]) == 0
    ), capfd.readouterr().err
