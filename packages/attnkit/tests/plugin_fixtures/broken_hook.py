"""A plugin whose registration hook raises."""

import attnkit

ATTNKIT_API_VERSION = 1


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(attnkit.AttentionSpec(name="half-done", family="custom", summary="x",
                                   factory="plugin_fixtures.good:Doubled"))
    raise RuntimeError("boom in the hook")
