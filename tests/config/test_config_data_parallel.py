"""Proves the data-parallel sizes load like every other setting (docs/operating/data-parallel.md).

Both default to 1; each comes from its flag, env or pod label, with its source; an unset
prefill size follows the local one, and its source names that; bad values (not a number,
0, above the bound, a number in other scripts) are refused naming value and source; sizes
for an engine that places ranks itself (TensorRT-LLM) are a warning.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from config_builders import load, write_podinfo

from sidecar.config.data_parallel import MAX_DATA_PARALLEL_SIZE
from sidecar.config.loader import ConfigError

DP_LABEL = "model.aibrix.ai/data-parallel-size"
PREFILL_DP_LABEL = "model.aibrix.ai/prefill-data-parallel-size"


def test_default_is_one_rank_on_both_sides() -> None:
    loaded = load()
    assert loaded.settings.data_parallel_size == 1
    assert loaded.settings.prefill_data_parallel_size == 1
    assert loaded.sources["data_parallel_size"] == "default"
    assert loaded.sources["prefill_data_parallel_size"] == "default"


def test_flag_sets_both_sides_and_names_the_source() -> None:
    loaded = load(["--data-parallel-size", "4"])
    assert loaded.settings.data_parallel_size == 4
    assert loaded.settings.prefill_data_parallel_size == 4
    assert loaded.sources["data_parallel_size"] == "flag --data-parallel-size"
    assert loaded.sources["prefill_data_parallel_size"] == (
        "data_parallel_size (flag --data-parallel-size)"
    )


def test_env_and_own_prefill_size() -> None:
    loaded = load(env={"DISAGG_DATA_PARALLEL_SIZE": "2",
                       "DISAGG_PREFILL_DATA_PARALLEL_SIZE": "4"})
    assert (loaded.settings.data_parallel_size, loaded.settings.prefill_data_parallel_size) == (
        2, 4)
    assert loaded.sources["prefill_data_parallel_size"] == "env DISAGG_PREFILL_DATA_PARALLEL_SIZE"


def test_labels_below_flags(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={DP_LABEL: "2", PREFILL_DP_LABEL: "4"})
    loaded = load(podinfo=pod)
    assert (loaded.settings.data_parallel_size, loaded.settings.prefill_data_parallel_size) == (
        2, 4)
    assert loaded.sources["data_parallel_size"] == f"label {DP_LABEL}"
    assert loaded.sources["prefill_data_parallel_size"] == f"label {PREFILL_DP_LABEL}"
    flagged = load(["--prefill-data-parallel-size", "1"], podinfo=pod)
    assert flagged.settings.prefill_data_parallel_size == 1
    assert flagged.sources["prefill_data_parallel_size"] == "flag --prefill-data-parallel-size"


def test_local_label_alone_sets_the_prefill_size(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={DP_LABEL: "8"})
    loaded = load(podinfo=pod)
    assert loaded.settings.prefill_data_parallel_size == 8
    assert loaded.sources["prefill_data_parallel_size"] == f"data_parallel_size (label {DP_LABEL})"


def test_label_keys_are_configurable(tmp_path: Path) -> None:
    pod = write_podinfo(tmp_path, labels={"dp": "2"})
    loaded = load(["--data-parallel-size-label", "dp"], podinfo=pod)
    assert loaded.settings.data_parallel_size == 2
    assert loaded.sources["data_parallel_size"] == "label dp"


@pytest.mark.parametrize("value", ["x", "0", "-1", str(MAX_DATA_PARALLEL_SIZE + 1), "2.5",
                                   "\uff12"])
def test_bad_sizes_are_refused_naming_the_source(tmp_path: Path, value: str) -> None:
    pod = write_podinfo(tmp_path, labels={PREFILL_DP_LABEL: value})
    with pytest.raises(ConfigError) as label:
        load(podinfo=pod)
    assert "prefill_data_parallel_size" in str(label.value)
    assert f"label {PREFILL_DP_LABEL}" in str(label.value)
    with pytest.raises(ConfigError) as flag:
        load(["--data-parallel-size", value])
    assert "flag --data-parallel-size" in str(flag.value)


def test_sizes_for_an_engine_that_places_ranks_itself_warn() -> None:
    loaded = load(["--engine", "trtllm", "--data-parallel-size", "2"])
    assert loaded.settings.data_parallel_size == 2
    assert any("data_parallel_size (from flag --data-parallel-size)" in warning
               and "names no rank" in warning for warning in loaded.warnings)
    assert load(["--engine", "sglang", "--data-parallel-size", "2"]).warnings == ()
    assert load(["--engine", "trtllm"]).warnings == ()
