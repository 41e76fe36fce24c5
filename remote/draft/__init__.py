"""The drafts: the kinds by name (registry.py; eagle3.py is the first), the EAGLE-3 config (config.py), model
(model.py), TTT objective (loss.py), batches (data.py), the draft vocabulary (vocab.py) and the exported folder's
one writer and reader (folder.py). Importing the package loads nothing (the registry stays light)."""
