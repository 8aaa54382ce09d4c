"""A second plugin that also registers ``doubled``."""

import attnkit

ATTNKIT_API_VERSION = 1


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(attnkit.AttentionSpec(name="doubled", family="other", summary="clash",
                                   factory="plugin_fixtures.good:Doubled"))
