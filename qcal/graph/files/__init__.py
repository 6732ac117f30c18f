"""Model files: loading safely, writing whole or not at all, and models of any size."""
