"""Training guards offline on CPU: a one-token guard fine-tuned from the default model and an embedding head.

`prepare.prepare_default_guards` builds `<data_dir>/guards/` for `lockgate models prepare` (layout in
`prepare`); `lockgate guard train` trains on any labelled set. `data` reads labelled sets and computes the
held-out figures, `layers` splits the model for training, `one_token` and `embedding` train one guard each.
Never imported by the service: registry/default_guards.py reads the guards directory's manifest itself.
"""
