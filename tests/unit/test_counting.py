"""The default instruments of a metrics backend are made once per process, for one choice of
the tenant label: a second set would duplicate instruments on the default registry."""

from __future__ import annotations

import pytest

from flask_idem import ConfigurationError
from flask_idem.ops.counting import PerProcess


def test_the_default_instruments_are_made_once_and_refuse_other_labels() -> None:
    made: list[bool] = []

    def make(label: bool) -> object:
        made.append(label)
        return object()

    defaults = PerProcess(make, "Idempotency(metrics=Metrics(registry=...))")
    first = defaults.get(True)
    assert defaults.get(True) is first and made == [True], "made on first use only"
    with pytest.raises(ConfigurationError, match=r"give one of them Idempotency\(metrics="):
        defaults.get(False)
    assert made == [True]
