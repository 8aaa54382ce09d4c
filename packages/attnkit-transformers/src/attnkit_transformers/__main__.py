"""``python -m attnkit_transformers``: print the generation-support table of docs/transformers.md."""

from attnkit_transformers import generation_table

print(generation_table())
