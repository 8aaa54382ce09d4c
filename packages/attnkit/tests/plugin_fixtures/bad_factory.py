"""A plugin whose factory path does not import."""

import attnkit

ATTNKIT_API_VERSION = 1


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(attnkit.AttentionSpec(name="missing-module", family="custom", summary="x",
                                   factory="plugin_fixtures.does_not_exist:Nothing"))
