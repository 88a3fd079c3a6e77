"""The one byte-size rule (telemetry.units): SI and binary units, bare K/M/G/T binary, ints as they are."""

import argparse

import pytest

from telemetry.units import byte_size, parse_bytes


@pytest.mark.parametrize("text, value", [
    ("1024", 1024), ("0", 0), ("7B", 7), (" 2 gb ", 2 * 10**9), ("1.5 KiB", 1536), (".5k", 512),
    ("1KB", 1000), ("1MB", 10**6), ("1TB", 10**12),
    ("1KiB", 1 << 10), ("512MiB", 512 << 20), ("1GiB", 1 << 30), ("1TiB", 1 << 40),
    ("1k", 1 << 10), ("64M", 64 << 20), ("1.5g", 3 << 29), ("2T", 2 << 40),
])
def test_units(text, value):
    assert parse_bytes(text) == value


def test_ints_are_bytes_and_bools_are_not():
    assert parse_bytes(4096) == 4096
    with pytest.raises(ValueError):
        parse_bytes(True)


@pytest.mark.parametrize("text", ["lots", "", "1.", "1 KiBs", "-1", "1e3", "GiB", "1 2"])
def test_anything_else_is_refused(text):
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes(text)


def test_byte_size_is_an_argparse_type():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=byte_size)
    assert parser.parse_args(["--size", "4GiB"]).size == 4 << 30
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not a byte size"):
        byte_size("x")
