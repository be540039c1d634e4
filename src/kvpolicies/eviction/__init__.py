"""Built-in policies; each module registers one policy."""
