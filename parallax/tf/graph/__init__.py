"""What a traced step is made of: `variables.py` (`ParallaxVariable`), `remote.py`
(`RemoteTable`: a table's pulls and pushes as graph ops with gradients; `StepTrace`: the step
the strategy traces, its fusion and its lookups' gradients), `fusion.py` (one pull op and one
push op per step) and `analysis.py` (how each variable is read in the traced step). It
imports no other room of `parallax.tf`."""
