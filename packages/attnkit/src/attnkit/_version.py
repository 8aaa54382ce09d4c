"""Package and plugin API versions."""

__version__ = "0.1.0"

#: Major version of the plugin API. A plugin declares the version it was built
#: for as ``ATTNKIT_API_VERSION`` in its plugin module; the loader skips a
#: plugin whose major version differs, with a warning saying what to upgrade.
API_VERSION = 1
