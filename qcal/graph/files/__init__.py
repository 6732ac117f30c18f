"""Model files: loading safely (`load`), writing whole or not at all (`save`, `atomic`), and
models of any size (`large`)."""
