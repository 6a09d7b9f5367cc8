"""Every settings rule, with its exact message."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from loaderplug.engine.sizing import chunk_for_source, default_sizing, workers_for_chunk
from loaderplug.errors import SettingsError
from loaderplug.settings import BY_FIELD, RENAMED, Settings, from_env, settings_table
from loaderplug.units import GiB, MiB


def test_defaults() -> None:
    s = from_env({})
    assert (s.readers, s.bytes_in_flight, chunk_for_source(s)) == (
        "auto",
        512 * MiB,
        16 * MiB,
    )
    # Auto may climb to 32 readers of 16 MiB; 64 MiB ranges would leave room for 8.
    assert default_sizing(s).workers == 32
    assert workers_for_chunk(s, 64 * MiB) == 8
    assert s.fsync is True and s.span_bytes is None
    assert all(src == "default" for src in s.origins.values())


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
    assert from_env({"LOADERPLUG_SPAN_BYTES": raw}).span_bytes == expected


def test_bad_size_names_variable_value_form_and_range() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_SPAN_BYTES": "12Q"})
    assert str(info.value) == (
        "LOADERPLUG_SPAN_BYTES='12Q' is invalid: expected a size in bytes such as 64M or 1GiB, "
        "from 4 KiB to 4 GiB"
    )


def test_out_of_range_int_is_refused_with_its_range() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_READERS": "0"})
    assert str(info.value) == (
        "LOADERPLUG_READERS='0' is invalid: expected auto, or an integer from 1 to 512"
    )


def test_zero_is_a_value_not_a_default() -> None:
    s = from_env({"LOADERPLUG_SPLIT_THRESHOLD_BYTES": "0", "LOADERPLUG_RETRY_BASE_MS": "0"})
    assert s.split_threshold_bytes == 0 and s.retry_base_ms == 0


def test_empty_means_unset() -> None:
    s = from_env({"LOADERPLUG_READERS": "", "LOADERPLUG_SPAN_BYTES": "  "})
    assert s.readers == "auto" and s.span_bytes is None
    assert s.origins["readers"] == "default"


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_rejected_where_an_int_is_expected(value: bool) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({}, readers=value)
    assert str(info.value) == (
        f"LOADERPLUG_READERS={value!r} is invalid: expected auto, or an integer from 1 to 512"
    )


def test_bool_word_is_rejected_for_an_int_variable() -> None:
    with pytest.raises(SettingsError, match=r"LOADERPLUG_RETRY_ATTEMPTS='true' is invalid"):
        from_env({"LOADERPLUG_RETRY_ATTEMPTS": "true"})


def test_bool_is_rejected_for_a_size() -> None:
    with pytest.raises(SettingsError, match=r"LOADERPLUG_SPAN_BYTES=True is invalid"):
        from_env({}, span_bytes=True)


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


@pytest.mark.parametrize(("raw", "owned"), [("", "auto"), ("own", "own"), (" MAP ", "map")])
def test_owned_is_auto_own_or_map(raw: str, owned: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new values are not deprecated
        assert from_env({"LOADERPLUG_OWNED": raw}).owned == owned


def test_a_bad_owned_names_the_choices() -> None:
    with pytest.raises(SettingsError) as info:
        from_env({"LOADERPLUG_OWNED": "always"})
    assert str(info.value) == (
        "LOADERPLUG_OWNED='always' is invalid: expected one of auto, own, map"
    )


# Each way a value is given: the environment, a keyword of from_env, Settings.replace.
OWNED_GIVEN: dict[str, Callable[[str], Settings]] = {
    "environment": lambda raw: from_env({"LOADERPLUG_OWNED": raw}),
    "from_env": lambda raw: from_env({}, owned=raw),
    "replace": lambda raw: from_env({}).replace(owned=raw),
}


@pytest.mark.parametrize("given", sorted(OWNED_GIVEN))
@pytest.mark.parametrize(("raw", "old", "new"), [("on", "on", "own"), (" OFF ", "off", "map")])
def test_an_old_owned_value_works_for_a_release_and_warns_once_naming_the_new_one(
    given: str, raw: str, old: str, new: str
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert OWNED_GIVEN[given](raw).owned == new
    assert [type(w.message) for w in caught] == [DeprecationWarning]
    assert str(caught[0].message) == (
        f"LOADERPLUG_OWNED={old} is now LOADERPLUG_OWNED={new} (the same behaviour); "
        "the old value goes in the next release"
    )
    assert caught[0].filename == __file__  # the line that gave the old value


def test_the_settings_table_names_the_old_owned_values() -> None:
    row = next(line for line in settings_table().splitlines() if "`LOADERPLUG_OWNED`" in line)
    assert "one of auto, own, map (`on` is now `own`, `off` is now `map`)" in row


def test_unknown_variable_warns_with_the_closest_name() -> None:
    with pytest.warns(UserWarning) as record:
        from_env({"LOADERPLUG_HYDRATE_WORKER": "4"})
    assert str(record[0].message) == (
        "LOADERPLUG_HYDRATE_WORKER is not a loaderplug setting and is ignored; "
        "did you mean LOADERPLUG_READERS?"
    )


def test_overrides_win_over_the_environment_and_are_checked() -> None:
    s = from_env({"LOADERPLUG_READERS": "4"}, readers=16)
    assert s.readers == 16 and s.origins["readers"] == "override"
    assert from_env({"LOADERPLUG_READERS": "4"}, readers=None).readers == 4
    with pytest.raises(SettingsError) as info:
        from_env({}, hydrate_worker=3)
    assert str(info.value) == "unknown setting 'hydrate_worker'; did you mean 'readers'?"


def test_settings_are_frozen() -> None:
    s = from_env({})
    with pytest.raises(AttributeError):
        s.readers = 3  # type: ignore[misc]


def test_disable_plugins_is_a_list_of_names() -> None:
    s = from_env({"LOADERPLUG_DISABLE_PLUGINS": "a, b,,c"})
    assert s.disable_plugins == ("a", "b", "c")


OLD_VALUES = {
    "volume": "/mnt/old",
    "hydrate_workers": "4",
    "chunk_bytes": "8M",
    "local_dir": "/local/old",
    "reader": "fastsafetensors",
}
NEW_VALUES = {
    "mirror": "/mnt/new",
    "readers": "8",
    "span_bytes": "16M",
    "local_copies": "/local/new",
    "weights_reader": "loaderplug",
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_setting_keeps_its_old_name_for_a_release(old: str) -> None:
    new, raw = RENAMED[old], OLD_VALUES[old]
    want = from_env({}, **{new: raw}).__dict__[new]
    with pytest.warns(DeprecationWarning, match=f"{old.upper()}.*now {new}"):
        assert from_env({f"LOADERPLUG_{old.upper()}": raw}).__dict__[new] == want
    with pytest.warns(DeprecationWarning, match=f"now {new}"):
        settings = from_env({}, **{old: raw})
    assert settings.__dict__[new] == want
    with pytest.warns(DeprecationWarning, match=f"now {new}"):
        assert getattr(settings, old) == want
    with pytest.warns(DeprecationWarning, match=f"now {new}"):
        assert from_env({}).replace(**{old: raw}).__dict__[new] == want
    # Both set: the new name wins.
    both = {f"LOADERPLUG_{old.upper()}": raw, f"LOADERPLUG_{new.upper()}": NEW_VALUES[new]}
    with pytest.warns(DeprecationWarning):
        assert from_env(both).__dict__[new] == from_env({}, **{new: NEW_VALUES[new]}).__dict__[new]
    assert RENAMED.keys().isdisjoint(BY_FIELD)  # an old name is never a field again
