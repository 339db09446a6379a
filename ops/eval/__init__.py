"""Guard evaluation from the command line: score a labelled set with a cascade, replay thresholds, report.

The library behind it is `ops.eval.evaluation` (pure, no models; the labelled items and the metrics serving
uses too are `guard.labelled`); this package adds building a cascade from a policy file (`ops.eval.cascades`),
the markdown report (`ops.eval.report`) and the CLI (`python -m ops.eval`).
The labelled development set and what it is (and is not) good for: `ops/eval/data/README.md`.
"""
