"""Every settings rule, with its exact message."""

from __future__ import annotations

import pytest

from loaderplug.errors import SettingsError
from loaderplug.settings import GiB, MiB, from_env


def test_defaults() -> None:
    s = from_env({})
    assert (s.hydrate_workers, s.bytes_in_flight, s.effective_chunk_bytes) == (
        "auto",
        512 * MiB,
        16 * MiB,
    )
    # Auto may climb to 32 readers of 16 MiB; 64 MiB ranges would leave room for 8.
    assert s.effective_workers == 32
    assert s.workers_for_chunk(64 * MiB) == 8
    assert s.fsync is True and s.chunk_bytes is None
    assert all(src == "default" for src in s.sources.values())


def test_workers_alone_scale_the_chunk_to_the_budget() -> None:
    s = from_env({"LOADERPLUG_HYDRATE_WORKERS": "32"})
    assert s.effective_chunk_bytes == 16 * MiB
    assert s.effective_workers == 32


def test_derived_chunk_is_capped_at_64_mib() -> None:
    assert from_env({"LOADERPLUG_BYTES_IN_FLIGHT": "4GiB"}).effective_chunk_bytes == 64 * MiB


def test_explicit_chunk_is_never_rescaled_and_the_budget_limits_workers() -> None:
    s = from_env({"LOADERPLUG_CHUNK_BYTES": "256M"})
    assert s.effective_chunk_bytes == 256 * MiB
    assert s.effective_workers == 2  # 512 MiB in flight / 256 MiB


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("64M", 64 * MiB),
        ("64MiB", 64 * MiB),
        ("1GiB", GiB),
        ("1g", GiB),
        ("512k", 512 * 1024),
        ("4096", 4096),
        ("8MB", 8 * MiB),
        (" 2 G ", 2 * GiB),
    ],
)
def test_sizes_accept_binary_suffixes(raw: str, expected: int) -> None:
    assert from_env({"LOADERPLUG_CHUNK_BYTES": raw}).chunk_bytes == expected


def test_bad_size_names_variable_value_form_and_range() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_CHUNK_BYTES": "12Q"})
    assert str(info.value) == (
        "LOADERPLUG_CHUNK_BYTES='12Q' is invalid: expected a size in bytes such as 64M or 1GiB, "
        "from 4 KiB to 4 GiB"
    )


def test_out_of_range_int_is_refused_with_its_range() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_HYDRATE_WORKERS": "0"})
    assert str(info.value) == (
        "LOADERPLUG_HYDRATE_WORKERS='0' is invalid: expected auto, or an integer from 1 to 512"
    )


def test_zero_is_a_value_not_a_default() -> None:
    s = from_env({"LOADERPLUG_SPLIT_THRESHOLD_BYTES": "0", "LOADERPLUG_RETRY_BASE_MS": "0"})
    assert s.split_threshold_bytes == 0 and s.retry_base_ms == 0


def test_empty_means_unset() -> None:
    s = from_env({"LOADERPLUG_HYDRATE_WORKERS": "", "LOADERPLUG_CHUNK_BYTES": "  "})
    assert s.hydrate_workers == "auto" and s.chunk_bytes is None
    assert s.sources["hydrate_workers"] == "default"


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_rejected_where_an_int_is_expected(value: bool) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({}, hydrate_workers=value)
    assert str(info.value) == (
        f"LOADERPLUG_HYDRATE_WORKERS={value!r} is invalid: "
        "expected auto, or an integer from 1 to 512"
    )


def test_bool_word_is_rejected_for_an_int_variable() -> None:
    with pytest.raises(SettingsError, match=r"LOADERPLUG_RETRY_ATTEMPTS='true' is invalid"):
        from_env({"LOADERPLUG_RETRY_ATTEMPTS": "true"})


def test_bool_is_rejected_for_a_size() -> None:
    with pytest.raises(SettingsError, match=r"LOADERPLUG_CHUNK_BYTES=True is invalid"):
        from_env({}, chunk_bytes=True)


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("off", False), ("Yes", True), ("0", False)]
)
def test_booleans(raw: str, value: bool) -> None:
    assert from_env({"LOADERPLUG_FSYNC": raw}).fsync is value


def test_bad_boolean() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_FSYNC": "maybe"})
    assert str(info.value) == (
        "LOADERPLUG_FSYNC='maybe' is invalid: expected one of 1, 0, true, false, yes, no, on, off"
    )


def test_bad_choice() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_DIRECT_IO": "sometimes"})
    assert str(info.value) == (
        "LOADERPLUG_DIRECT_IO='sometimes' is invalid: expected one of auto, on, off"
    )


def test_unknown_variable_warns_with_the_closest_name() -> None:
    with pytest.warns(UserWarning) as record:
        from_env({"LOADERPLUG_HYDRATE_WORKER": "4"})
    assert str(record[0].message) == (
        "LOADERPLUG_HYDRATE_WORKER is not a loaderplug setting and is ignored; "
        "did you mean LOADERPLUG_HYDRATE_WORKERS?"
    )


def test_overrides_win_over_the_environment_and_are_checked() -> None:
    s = from_env({"LOADERPLUG_HYDRATE_WORKERS": "4"}, hydrate_workers=16)
    assert s.hydrate_workers == 16 and s.sources["hydrate_workers"] == "override"
    assert from_env({"LOADERPLUG_HYDRATE_WORKERS": "4"}, hydrate_workers=None).hydrate_workers == 4
    with pytest.raises(SettingsError) as info:
        from_env({}, hydrate_worker=3)
    assert str(info.value) == "unknown setting 'hydrate_worker'; did you mean 'hydrate_workers'?"


def test_settings_are_frozen() -> None:
    s = from_env({})
    with pytest.raises(AttributeError):
        s.hydrate_workers = 3  # type: ignore[misc]


def test_disable_plugins_is_a_list_of_names() -> None:
    s = from_env({"LOADERPLUG_DISABLE_PLUGINS": "a, b,,c"})
    assert s.disable_plugins == ("a", "b", "c")


def test_auto_workers_split_the_budget_for_the_most_readers_auto_may_run() -> None:
    s = from_env({"LOADERPLUG_HYDRATE_WORKERS": " Auto "})
    assert s.adaptive_workers and s.hydrate_workers == "auto"
    assert (s.effective_chunk_bytes, s.effective_workers) == (16 * MiB, 32)
    # Small jobs are fitted for the sixteen workers auto starts with, as for sixteen
    # fixed workers.
    fixed = from_env({"LOADERPLUG_HYDRATE_WORKERS": "16"})
    assert s.chunk_for_job(1024 * MiB) == fixed.chunk_for_job(1024 * MiB) == 8 * MiB
    assert s.chunk_for_job(4096 * MiB) == 16 * MiB
    # From a local disk auto reads long ranges, at most 8 at once, whatever the job.
    assert s.chunk_for_job(1024 * MiB, network=False) == 64 * MiB
    assert s.workers_for_chunk(64 * MiB) == 8
    assert fixed.chunk_for_job(1024 * MiB, network=False) == 8 * MiB
    # An explicit chunk leaves room for fewer readers within the same budget.
    explicit = from_env({"LOADERPLUG_HYDRATE_WORKERS": "auto", "LOADERPLUG_CHUNK_BYTES": "64M"})
    assert explicit.effective_workers == 8
