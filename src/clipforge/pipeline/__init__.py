"""The pipeline as a whole (data -> train -> eval): every section of params.yaml together.

Every section of params.yaml together, which
`fab train` checks before it ships a run and from which params.yaml's knob docs are written. Above
the stages: nothing a stage runs imports it.
"""
