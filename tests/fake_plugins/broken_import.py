"""A plugin whose import fails (a missing dependency)."""

import kvcore_fake_dependency_that_is_not_installed  # noqa: F401
