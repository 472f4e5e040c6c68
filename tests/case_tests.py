"""One test method per named case, for suites that run one check over a
list of models (`test_flexflow_suite`, `test_search_suite`)."""

import pytest


def add_case_tests(cls, quick: tuple[str, ...], slow: tuple[str, ...]):
    """Gives `cls` a `test_<name>` calling `self.check(name)` per case;
    those in `slow` are marked slow (deselected by default)."""
    for name in quick + slow:
        def test(self, name=name):
            self.check(name)

        test.__name__ = f"test_{name}"
        if name in slow:
            test = pytest.mark.slow(test)
        setattr(cls, f"test_{name}", test)
    return cls
