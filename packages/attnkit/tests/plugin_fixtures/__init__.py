"""Plugin modules that the registry tests load through fake entry points."""
