"""A plugin whose hook name is misspelled: it must be reported, not shown as loaded with nothing."""

import attnkit

ATTNKIT_API_VERSION = 1


@attnkit.hookimpl
def attnkit_register_atention(register):
    register(attnkit.AttentionSpec(name="never-seen", family="custom", summary="x",
                                   factory="plugin_fixtures.good:Doubled"))
