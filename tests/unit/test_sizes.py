import pytest

from sidecar.sizes import DiskLimit, parse_size


@pytest.mark.parametrize("text,expected", [("123", 123), ("10GB", 10**10), ("10 GiB", 10 * 2**30),
                                           ("1.5MB", 1_500_000), ("2kib", 2048)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "ten", "10 parsecs", "-1GB", "1e3"])
def test_parse_size_refuses_with_what_is_accepted(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_disk_limit_by_bytes_and_by_percent():
    assert DiskLimit.parse("1GB").exceeded(10**9 + 1, 10**12)
    assert not DiskLimit.parse("1GB").exceeded(10**9, 10**12)
    assert DiskLimit.parse("80%").exceeded(81, 100)
    assert not DiskLimit.parse("80%").exceeded(80, 100)
    for bad in ("0%", "101%", "x%"):
        with pytest.raises(ValueError, match="percentage"):
            DiskLimit.parse(bad)
