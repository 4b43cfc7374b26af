"""Fault injection (kvserve/platform/faults.py): the spec parser's errors, seeded draws, disarmed fast path."""

from __future__ import annotations

import errno

import pytest

from kvserve.platform.faults import FAULT_MARK, fault_point, faults, parse_faults


def test_parse_faults_reads_probabilities_and_errno_names():
    armed = parse_faults("swap=0.05, module-dir-write=1:ENOSPC,")
    assert armed == {"swap": (0.05, errno.EIO), "module-dir-write": (1.0, errno.ENOSPC)}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("swp=0.1", "unknown fault point 'swp'"),
        ("swap", "needs a probability"),
        ("swap=2", "must be in [0, 1]"),
        ("swap=0.5:EWHAT", "not an errno name"),
    ],
)
def test_parse_faults_names_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_faults(spec)


def test_an_armed_point_raises_its_errno_with_the_mark_and_a_disarmed_one_nothing():
    with faults({"swap": (1.0, errno.ENOSPC)}) as injected:
        with pytest.raises(OSError) as raised:
            fault_point("swap", "/tmp/x")
        fault_point("kv-disk")  # not armed
    assert raised.value.errno == errno.ENOSPC and FAULT_MARK in str(raised.value)
    assert raised.value.filename == "/tmp/x"
    assert injected == {"swap": 1}
    fault_point("swap")  # disarmed after the block


def test_draws_are_seeded():
    def draws(seed: int) -> list[bool]:
        out = []
        with faults({"kv-disk": 0.5}, seed=seed):
            for _ in range(64):
                try:
                    fault_point("kv-disk")
                    out.append(False)
                except OSError:
                    out.append(True)
        return out

    assert draws(1) == draws(1)
    assert 10 < sum(draws(1)) < 54
    assert draws(1) != draws(2)
