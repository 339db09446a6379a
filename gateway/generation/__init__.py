"""The generation path, read top to bottom in `pipeline.py`: decode -> resolve -> render -> reserve -> input
guard -> generate -> output guard -> respond. The other modules are its stages and the stream's plumbing."""
