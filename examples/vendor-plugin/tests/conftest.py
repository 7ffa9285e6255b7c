"""The example's tests need it installed (its entry point is what kvcore finds), and the second vendor beside it."""

import importlib.util

import pytest

missing = [name for name in ("kvcore_acme", "kvcore_zeta") if importlib.util.find_spec(name) is None]
if missing:
    raise pytest.UsageError(
        f"the vendor examples are not installed ({', '.join(missing)}): "
        "pip install -e examples/vendor-plugin -e examples/second-vendor-plugin"
    )
