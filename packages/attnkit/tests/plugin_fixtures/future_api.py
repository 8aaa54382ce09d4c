"""A plugin built for a future API major version."""

import attnkit

ATTNKIT_API_VERSION = 2


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(attnkit.AttentionSpec(name="from-the-future", family="custom", summary="x",
                                   factory="plugin_fixtures.good:Doubled"))
