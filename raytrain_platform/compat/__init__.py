"""The private APIs of torch and Ray this package relies on, each in one place
(`torch_private`, `ray_private`) with what it is used for and why no public API does the
job. tests/test_compat.py resolves every one of them, so an upgrade that removes or
moves one fails there, by name, instead of a feature quietly going missing."""
