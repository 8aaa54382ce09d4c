"""pytest configuration of the memory plugin's tests (helpers live in ``memory_helpers``)."""
