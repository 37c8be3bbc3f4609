"""Proves ``jsonutil.loads_exact`` refuses exactly the integers beyond 64 bits, wherever they
are, and lets every other document through as ``orjson`` reads it: the long-digit-run scan
that decides whether the slow second reading runs at all (a byte translation and a search)
finds a run of 19 ASCII digits and only that. Does not prove the client-facing error (the
protocol-level suite's)."""

from __future__ import annotations

import orjson
import pytest

from sidecar import jsonutil


@pytest.mark.parametrize("literal", [
    b"18446744073709551615",  # 2**64 - 1: the largest an engine's uint64 field takes
    b"-9223372036854775808",  # -(2**63)
    b"999999999999999999",  # 18 digits: no run to look at
    b"0",
])
def test_integers_within_64_bits_are_read_as_integers(literal: bytes) -> None:
    document = b'{"seed": ' + literal + b"}"
    assert jsonutil.loads_exact(document) == {"seed": int(literal)}


@pytest.mark.parametrize(("document", "path"), [
    (b'{"seed": 18446744073709551616}', "seed"),
    (b'{"a": [1, {"b": -9223372036854775809}]}', "a[1].b"),
    (b'{"logit_bias": {"50256": 123456789012345678901234567890}}', "logit_bias.50256"),
    (b"[12345678901234567890123]", "[0]"),
])
def test_integers_beyond_64_bits_are_refused_where_they_are(document: bytes, path: str) -> None:
    with pytest.raises(jsonutil.IntegerOutOfRange) as refused:
        jsonutil.loads_exact(document)
    assert refused.value.path == path


@pytest.mark.parametrize("document", [
    b'{"prompt": "call 12345678901234567890123 now"}',  # a run inside a string
    b'{"x": 1.2345678901234567890123}',  # a run in a fraction
    b'{"x": 12345678901234567890e-3}',  # a float literal with an exponent
    '{"prompt": "\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660'
    '\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660"}'.encode(),
])
def test_long_digit_runs_that_are_no_integer_pass_as_orjson_reads_them(document: bytes) -> None:
    assert jsonutil.loads_exact(document) == orjson.loads(document)


def test_only_a_whole_run_of_19_digits_costs_the_second_reading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    second_readings: list[str] = []
    standard_loads = jsonutil.json.loads

    def counted(text: str, **kwargs: object) -> object:
        second_readings.append(text)
        return standard_loads(text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jsonutil.json, "loads", counted)
    digits = b"1234567890123456789"
    for cut in range(1, len(digits)):  # every place a run of 19 can be broken
        document = b'{"a": "' + digits[:cut] + b" " + digits[cut:] + b'", "n": 18}'
        assert jsonutil.loads_exact(document)["n"] == 18
    assert second_readings == []
    assert jsonutil.loads_exact(b'{"a": "x' + digits + b'x"}') == {"a": f"x{digits.decode()}x"}
    assert len(second_readings) == 1
