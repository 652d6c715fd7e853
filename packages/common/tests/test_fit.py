"""A rank's memory by device kind, and the verdict and largest batch the dry run reads from it."""

from qwen3_titan_common.perf.fit import (
    GIB,
    RankMemory,
    available_host_bytes,
    largest_batch,
    rank_memory,
    verdict,
)


def test_host_memory_is_what_an_allocation_can_get(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20480000 kB\n")
    assert available_host_bytes(meminfo) == 20480000 * 1024


def test_a_cpu_rank_shares_the_host_and_a_trn2_core_has_a_quarter_chip():
    one, four = rank_memory("cpu", 1), rank_memory("cpu", 4)
    assert one is not None and four is not None
    assert (
        abs(four.bytes_per_rank - one.bytes_per_rank // 4) <= 64 * 1024**2
    )  # MemAvailable moves between reads
    assert "/ 4 ranks" in four.described
    assert rank_memory("neuron", 64) == RankMemory(24 * GIB, "neuron: 24 GiB per trn2 logical core at LNC=2")
    assert rank_memory("tpu", 1) is None


def test_verdict_and_the_largest_batch_by_the_same_estimate():
    memory = RankMemory(10 * GIB, "test")
    assert verdict(5 * GIB, memory) == "fits"
    assert verdict(int(9.5 * GIB), memory) == "near the limit"
    assert verdict(11 * GIB, memory) == "does not fit"
    # 2 GiB of weights and optimizer state, 1 GiB of activations per row: 8 rows fit in 10 GiB.
    assert largest_batch(2 * GIB, 16 * GIB, 16, memory) == 8
    assert largest_batch(12 * GIB, 16 * GIB, 16, memory) == 0


def test_a_stated_memory_is_a_device_or_gib():
    import pytest
    from qwen3_titan_common.perf.fit import stated_memory

    assert stated_memory("trn2").bytes_per_rank == 24 * GIB
    assert stated_memory("H100").bytes_per_rank == 80 * 10**9
    assert stated_memory("1.5") == RankMemory(int(1.5 * GIB), "--memory-per-rank 1.5")
    for bad in ("0", "-2", "inf", "nan", "a100x"):
        with pytest.raises(ValueError):
            stated_memory(bad)
