"""A plugin registering one attention class under two names and a block."""

import attnkit
from attnkit.layers import TransformerBlock
from plugin_fixtures.good import Doubled

ATTNKIT_API_VERSION = 1


class Residual2(TransformerBlock):
    """The pre-norm block with its attention output added twice (a stand-in block mechanism)."""

    def forward(self, x, **kw):
        return super().forward(x, **kw)


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(Doubled, name="doubled-a", family="custom", summary="a", capabilities=attnkit.Capabilities(
        attn_mask=True))
    register(Doubled, name="doubled-b", family="custom", summary="b", capabilities=attnkit.Capabilities(
        attn_mask=False, causal=False))


@attnkit.hookimpl
def attnkit_register_block(register):
    register(attnkit.BlockSpec(name="residual-two", factory="plugin_fixtures.blocks:Residual2",
                               family="custom", summary="a test block", aliases=("r2",)))
