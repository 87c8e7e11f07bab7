"""Mechanism for everything else: socket server, engine, executor, store."""
