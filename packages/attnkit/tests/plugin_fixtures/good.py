"""A well-behaved plugin: one attention and one command."""

import attnkit
from attnkit.softmax import SoftmaxAttention

ATTNKIT_API_VERSION = 1


class Doubled(SoftmaxAttention):
    """Softmax attention times two (a stand-in mechanism)."""

    def _forward(self, q, k, v, **kw):
        return 2 * super()._forward(q, k, v, **kw)


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(Doubled, name="doubled", family="custom", aliases=("twice",),
             summary="softmax times two", capabilities=attnkit.Capabilities(attn_mask=True))


@attnkit.hookimpl
def attnkit_register_commands(cli):
    cli.add_command("hello", help="say hello", configure=lambda p: p.add_argument("--who", default="world"),
                    run=lambda args: print(f"hello {args.who}") or 0)
