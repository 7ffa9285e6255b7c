"""Small kvcore plugins for tests/test_plugins.py, loaded through fake ``kvcore`` entry points.

Each module is one plugin; ``_common`` builds the records they register.
"""
